"""PTQ end to end: calibrate at several (world, ep) layouts, export, and get the same bytes."""

import json
import os
from datetime import timedelta

import pytest
import torch

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import distinct_models, make_tiny
from tests.ep_checks import RECIPES, same_files
from tests.multiproc import free_port, run_world

FAMILIES = distinct_models()
# (world, ep) -> (batch size, chunk size) the layout calibrates with: each layout takes another,
# so the byte-identical exports show that neither the layout nor the batch or chunk size moves a bit.
LAYOUTS = {(1, 1): (1, None), (2, 2): (3, 2), (2, 1): (8, 5), (4, 2): (1, 5), (4, 4): (3, 2)}
# World 4 runs four processes on the test machine's cores: it calibrates the families whose own
# layout test (tests/ep_checks.py's `assert_exports_layout_invariant`, test_kimi_ep.py,
# test_qwen_next_ep.py, test_llama4_ep.py) does not already run them at world 4.
WORLD_4_FAMILIES = ["qwen3_moe", "deepseek_v3", "kimi_linear", "kimi_k25"]
# 48 tokens per expert work unit's group (2 sequences of 24): the 9 sequences make 5 groups
GROUP_TOKENS = 48
# held-out sequences of the quality report: at world 4 a rank holds none, and its exports
# (eprt_quality.json among them) must still be the same bytes
EVAL_SIZE = 3


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("ptq")
    # 8 experts, top-2 over a few short sequences: some experts see no token in some layout's share
    return {f: convert_hf(make_tiny(f, str(d / f / "hf")), str(d / f / "ck"), progress=False) for f in FAMILIES}


def calibrate(ckpts, out_root, layouts, ports):
    """On one rank: PTQ of every family and recipe at each ep in `layouts`, into out_root/<tag>.

    9 sequences: at world 2 and 4 some ranks hold no sequence of some steps, and still take
    part in every exchange."""
    for ep, port in zip(layouts, ports):
        os.environ["MASTER_PORT"] = str(port)
        with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
            batch, chunk = LAYOUTS[(state.world, ep)]
            for family, ck in ckpts.items():
                for recipe, kv, dtype in RECIPES:
                    out = os.path.join(out_root, f"{family}-{recipe}-w{state.world}-ep{ep}")
                    run_ptq(
                        state,
                        PTQArgs(
                            ck,
                            recipe,
                            out,
                            kv_cache=kv,
                            calib_size=9,
                            seq_len=24,
                            batch_size=batch,
                            chunk_size=chunk,
                            group_tokens=GROUP_TOKENS,
                            dtype=dtype,
                            eval_size=EVAL_SIZE,
                            progress=False,
                        ),
                    )


def export_all(out_root):
    exports = {}
    for name in sorted(os.listdir(out_root)):
        if name.startswith("export-"):
            continue
        exports[name] = export_hf(
            os.path.join(out_root, name), os.path.join(out_root, "export-" + name), progress=False
        )
    return exports


def test_exports_are_byte_identical_across_layouts_batch_and_chunk_sizes(ckpts, tmp_path):
    out = str(tmp_path)
    calibrate(ckpts, out, [1], [free_port()])
    run_world(calibrate, 2, ckpts, out, [2, 1], [free_port(), free_port()], timeout=600)
    run_world(
        calibrate, 4, {f: ckpts[f] for f in WORLD_4_FAMILIES}, out, [2, 4], [free_port(), free_port()], timeout=900
    )
    exports = export_all(out)
    for family in FAMILIES:
        layouts = ("w2-ep2", "w2-ep1") + (("w4-ep2", "w4-ep4") if family in WORLD_4_FAMILIES else ())
        for recipe, *_ in RECIPES:
            ref = exports[f"{family}-{recipe}-w1-ep1"]
            assert check_export(ref) == []
            for layout in layouts:
                assert same_files(ref, exports[f"{family}-{recipe}-{layout}"]), (family, recipe, layout)


def test_two_runs_are_byte_identical_and_the_input_is_referenced_not_copied(ckpts, tmp_path):
    ck = ckpts["deepseek_v3"]
    for run in ("a", "b"):
        run_ptq(
            ParallelState.single(),
            PTQArgs(ck, "nvfp4", str(tmp_path / run), kv_cache="fp8", calib_size=4, seq_len=16, progress=False),
        )
        export_hf(str(tmp_path / run), str(tmp_path / f"export-{run}"), progress=False)
    assert same_files(str(tmp_path / "export-a"), str(tmp_path / "export-b"))
    # the calibrated checkpoint holds the calibration state only; its weights are the input's
    assert not any(f.startswith(("layer-", "model")) for f in os.listdir(tmp_path / "a"))
    with Checkpoint(str(tmp_path / "a")) as q, Checkpoint(ck) as base:
        assert torch.equal(q.read("model.layers.1.mlp.experts.w13"), base.read("model.layers.1.mlp.experts.w13"))
        tokens = q.read("model.layers.1.mlp.experts.tokens")
        assert tokens.shape == (8,) and int(tokens.sum()) == 4 * 16 * 2  # every token's top-2 copies


def test_a_changed_input_is_detected(ckpts, tmp_path):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"))
    ck = convert_hf(src, str(tmp_path / "ck"), progress=False)
    run_ptq(ParallelState.single(), PTQArgs(ck, "fp8", str(tmp_path / "q"), calib_size=2, seq_len=8, progress=False))
    manifest = os.path.join(ck, "eprt.json")
    m = json.load(open(manifest))
    m["source_config"]["note"] = "edited"
    json.dump(m, open(manifest, "w"))
    with pytest.raises(Exception, match="changed since calibration"):
        Checkpoint(str(tmp_path / "q"))


def export_on_ranks(q_dir, out, port):
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(timeout=timedelta(seconds=60)) as state:
        export_hf(q_dir, out, max_shard_bytes=60_000, progress=False, parallel=state)
        return sorted(os.listdir(out)) if state.rank == 0 else None


def test_an_export_written_by_several_ranks_equals_the_single_process_one(ckpts, tmp_path):
    q = str(tmp_path / "q")
    run_ptq(
        ParallelState.single(),
        PTQArgs(ckpts["qwen3_moe"], "nvfp4", q, kv_cache="fp8", calib_size=2, seq_len=8, progress=False),
    )
    single = export_hf(q, str(tmp_path / "single"), max_shard_bytes=60_000, progress=False)
    files = run_world(export_on_ranks, 3, q, str(tmp_path / "ranks"), free_port(), timeout=120)[0]
    assert sum(f.endswith(".safetensors") for f in files) >= 4  # every rank wrote shards
    assert same_files(single, str(tmp_path / "ranks"))
