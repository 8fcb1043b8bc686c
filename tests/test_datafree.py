"""The data-free path (eprt.quant.run.datafree): a recipe that takes no activation statistic, under a
weight-only algorithm and without a KV cache, is quantized without calibration data or a forward pass.

- PTQ takes it with a calibration file that does not exist (and with none), writes no work
  directory and no calibration tensor, and its export is the calibrated path's, every file the
  same bytes, on a model with stacked MoE experts (Qwen3-MoE) and one with MLA (DeepSeek-V3).
- The export straight from the converted checkpoint (`--recipe`) is the same bytes, also from two
  ranks writing their shares of the shards; a recipe that needs statistics is refused by name
  with the way out, and so is a --recipe or --algorithm that cannot apply.
- A recipe with a KV cache, or a run asking for forward passes (--eval, --preview), keeps the
  calibrated path.
- The output appears whole or not at all: an existing one is refused without --overwrite,
  replaced with it, and kept as it was when the new one fails half written.
- --dry-run says the run is data-free and plans the export's memory, one tensor at a time.
"""

import filecmp
import os
import sys
from datetime import timedelta

import pytest
import torch

import eprt.commands.export as export_command
import eprt.commands.ptq as ptq_command
from eprt.errors import ConfigError, EprtError
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.hf.export_plan import plan_export
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.formats import WEIGHT_FORMATS, weight_format
from eprt.quant.formats.fp8_block import Fp8Block
from eprt.quant.run.datafree import data_free_formats
from eprt.quant.run.ptq import PTQArgs, run_calibration, run_ptq
from eprt.quant.run.setup import plan_recipe
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.multiproc import run_world

MISSING = "/nonexistent/calibration.jsonl"


def same_files(a: str, b: str) -> None:
    """Directories a and b hold the same file names, each the same bytes."""
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        assert filecmp.cmp(os.path.join(a, name), os.path.join(b, name), shallow=False), name


def build(family: str, d) -> tuple[str, str, str, str]:
    """(converted checkpoint, data-free ptq + export, calibrated ptq + export, direct export)."""
    ck = convert_hf(make_tiny(family, str(d / "hf")), str(d / "ck"), progress=False)
    single = ParallelState.single()
    run_ptq(single, PTQArgs(ck, "fp8_block", str(d / "q"), calib=(MISSING,), calib_size=4, progress=False))
    # the calibrated path of the same recipe, without the quality report a data-free run does not write
    run_calibration(
        single, PTQArgs(ck, "fp8_block", str(d / "qc"), calib_size=4, seq_len=16, eval_size=0, progress=False)
    )
    return (
        ck,
        export_hf(str(d / "q"), str(d / "e"), progress=False),
        export_hf(str(d / "qc"), str(d / "ec"), progress=False),
        export_hf(ck, str(d / "ed"), progress=False, recipe="fp8_block"),
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = {}

    def of(family: str) -> tuple[str, str, str, str]:
        if family not in cache:
            cache[family] = build(family, tmp_path_factory.mktemp(family))
        return cache[family]

    return of


@pytest.fixture(scope="module", params=["qwen3_moe", "deepseek_v3"])  # stacked MoE experts; MLA
def exports(request, built):
    return built(request.param)


@pytest.fixture(scope="module")
def qwen(built):
    return built("qwen3_moe")


def test_ptq_reads_no_data_and_exports_the_calibrated_bytes(exports):
    ck, data_free, calibrated, direct = exports
    q = os.path.dirname(data_free) + "/q"
    assert not os.path.exists(q + ".work")  # no layer boundary saved: no layer ran
    with Checkpoint(q) as c:
        assert c.names(role="calibration") == [] and c.quantization["calibration"]["data_free"]
    assert "hf_quant_config.json" in os.listdir(data_free)
    same_files(data_free, calibrated)
    same_files(direct, calibrated)


def test_no_calib_given_is_data_free_too(exports, tmp_path):
    ck, data_free, _, _ = exports
    run_ptq(ParallelState.single(), PTQArgs(ck, "fp8_block", str(tmp_path / "q"), progress=False))
    same_files(export_hf(str(tmp_path / "q"), str(tmp_path / "e"), progress=False), data_free)


@pytest.mark.parametrize(
    "settings",
    [
        {"kv_cache": "fp8", "calib": (MISSING,)},  # the KV cache's scales need amax
        {"algorithm": "gptq", "calib": (MISSING,)},  # GPTQ's Hessians need the inputs
        {"algorithm": "awq+gptq", "calib": (MISSING,)},  # so do AWQ's search and GPTQ's Hessians
        {"eval": MISSING},  # the quality report on --eval data runs the model
        {"preview": "Hello", "calib": (MISSING,)},  # so does the preview
    ],
)
def test_what_needs_forward_passes_keeps_the_calibrated_path(qwen, tmp_path, settings, caplog):
    """Calibration refuses the missing file, which the data-free path never reads; where the recipe
    itself needs the data (its algorithm, its KV cache), the log says why it calibrates."""
    with caplog.at_level("INFO", logger="eprt"), pytest.raises(EprtError, match=MISSING):
        run_ptq(ParallelState.single(), PTQArgs(qwen[0], "fp8_block", str(tmp_path / "q"), progress=False, **settings))
    assert not os.path.exists(tmp_path / "q")
    why = "algorithm" in settings or "kv_cache" in settings
    assert ("its formats take no activation statistic, but " in caplog.text) == why, caplog.text


@pytest.mark.parametrize(
    "recipe, says",
    [
        ("nvfp4", r"format nvfp4 scales its inputs by their calibrated amax"),
        ("kv.yaml", r"the fp8 KV cache is scaled by the keys' and values' calibrated amax"),
    ],
)
def test_direct_export_refuses_a_recipe_that_needs_statistics(qwen, tmp_path, recipe, says):
    ck = qwen[0]
    (tmp_path / "kv.yaml").write_text("name: kv\nquantize:\n  - {pattern: '*', format: fp8_block}\nkv_cache: fp8\n")
    spec = str(tmp_path / recipe) if recipe.endswith(".yaml") else recipe
    with pytest.raises(ConfigError, match=rf"--recipe .*{says}.*calibrate first \(eprt-ptq {ck} --recipe .* --out Q\)"):
        export_hf(ck, str(tmp_path / "out"), progress=False, recipe=spec)
    assert os.listdir(tmp_path) == ["kv.yaml"]


def test_inputs_and_options_that_cannot_apply_are_refused(qwen, tmp_path):
    ck, data_free, _, _ = qwen
    q = os.path.dirname(data_free) + "/q"
    with pytest.raises(EprtError, match=rf"{q} is already calibrated; run PTQ on the unquantized checkpoint"):
        run_ptq(ParallelState.single(), PTQArgs(q, "fp8_block", str(tmp_path / "c"), progress=False))
    with pytest.raises(ConfigError, match=rf"--recipe fp8_block: {q} is calibrated"):
        export_hf(q, str(tmp_path / "a"), progress=False, recipe="fp8_block")
    with pytest.raises(ConfigError, match=r"--algorithm mse applies to a --recipe's rules"):
        export_hf(ck, str(tmp_path / "b"), progress=False, algorithm="mse")
    assert os.listdir(tmp_path) == []


def test_outputs_appear_whole_and_replace_only_when_complete(qwen, tmp_path, monkeypatch):
    ck, data_free, _, direct = qwen
    out = str(tmp_path / "q")
    os.makedirs(out)
    (tmp_path / "q" / "keep").write_text("old")
    a = PTQArgs(ck, "fp8_block", out, progress=False)
    with pytest.raises(EprtError, match=r"exists and is not empty"):
        run_ptq(ParallelState.single(), a)
    run_ptq(ParallelState.single(), PTQArgs(ck, "fp8_block", out, resume=True, overwrite=True, progress=False))
    assert not os.path.exists(out + ".work")
    same_files(export_hf(out, str(tmp_path / "e"), progress=False), data_free)
    # an export that fails half written leaves the output it was to replace as it was, and nothing beside it
    calls = []

    def fail_on_the_third(self, w, w_scale, mse):
        calls.append(1)
        if len(calls) == 3:
            raise EprtError("disk gone")
        return original(self, w, w_scale, mse)

    original = Fp8Block.quantize
    monkeypatch.setattr(Fp8Block, "quantize", fail_on_the_third)
    with pytest.raises(EprtError, match="disk gone"):
        export_hf(ck, str(tmp_path / "e"), progress=False, recipe="fp8_block", overwrite=True)
    same_files(str(tmp_path / "e"), data_free)
    assert sorted(os.listdir(tmp_path)) == ["e", "q"]


@pytest.mark.parametrize("recipe, algorithm", [("nvfp4_a16", "mse"), ("fp8_channel", "max")])
def test_direct_export_equals_ptq_then_export(qwen, tmp_path, recipe, algorithm):
    ck = qwen[0]
    run_ptq(ParallelState.single(), PTQArgs(ck, recipe, str(tmp_path / "q"), algorithm=algorithm, progress=False))
    calibrated = export_hf(str(tmp_path / "q"), str(tmp_path / "e"), progress=False)
    same_files(export_hf(ck, str(tmp_path / "d"), progress=False, recipe=recipe, algorithm=algorithm), calibrated)


def test_the_commands(qwen, tmp_path, monkeypatch, capsys):
    ck, _, _, direct = qwen
    monkeypatch.setattr(sys, "argv", ["eprt-export", ck, str(tmp_path / "e"), "--recipe", "fp8_block", "--no-progress"])
    export_command.export()
    same_files(str(tmp_path / "e"), direct)
    monkeypatch.setattr(sys, "argv", ["eprt-ptq", ck, "--recipe", "fp8_block", "--calib", MISSING, "--dry-run"])
    assert ptq_command.ptq() == 0
    printed = capsys.readouterr().out
    assert "data-free run: recipe fp8_block (max) takes no activation statistic" in printed
    assert "one tensor resident at a time: peaks at" in printed and "expert rows of" in printed


def _direct_export(ck: str, out: str, shard_bytes: int) -> None:
    with ParallelState.from_env(timeout=timedelta(seconds=60)) as state:
        export_hf(ck, out, progress=False, recipe="fp8_block", max_shard_bytes=shard_bytes, parallel=state)


def test_two_ranks_write_the_same_shards(qwen, tmp_path):
    ck = qwen[0]
    shard_bytes = 64 * 1024  # several shards, so each rank writes some
    one = export_hf(ck, str(tmp_path / "one"), progress=False, recipe="fp8_block", max_shard_bytes=shard_bytes)
    run_world(_direct_export, 2, ck, str(tmp_path / "two"), shard_bytes, timeout=120)
    assert sum(n.endswith(".safetensors") for n in os.listdir(one)) > 2
    same_files(str(tmp_path / "two"), one)


def test_a_format_takes_activation_statistics_exactly_when_it_writes_an_input_scale():
    """The data-free path stands on this: a format without a static input scale, or one that pins
    it (NVFP4 with an input scale of 1), has nothing of calibration's to write."""
    for f in WEIGHT_FORMATS.values():
        calibrated = f.constant_input_amax is None
        assert f.uses_activation_statistics == (f.modelopt_per_tensor_scales[1] is not None and calibrated), f.name
        assert f.uses_activation_statistics == (f.ct_input_scale_leaf is not None and calibrated), f.name
    assert {"fp8_block", "fp8_channel", "nvfp4_a16"} <= set(data_free_formats())


def test_the_export_plan_counts_the_mse_search(qwen):
    """Under mse the plan adds the search's memory to the same export under max: its grids an
    element of the largest weight, and a chunk a quantizing thread."""
    ck = Checkpoint(qwen[0])
    rc = ResolvedCheckpoint.of(ck, torch.bfloat16)
    plans = {}
    for algorithm in ("max", "mse"):
        recipe, targets = plan_recipe(rc, "mxfp4", None, algorithm)
        plans[algorithm] = plan_export(ck, targets, recipe, 2, 0)
    dense = [ck.tensors[f"{m}.weight"] for m in targets if f"{m}.weight" in ck.tensors]
    fmt, widest = weight_format("mxfp4"), max(meta.shape[-1] for meta in dense)
    assert plans["mse"].buffers - plans["max"].buffers >= 3 * fmt.mse_search_bytes(widest)  # 2 workers and the producer
    assert plans["mse"].largest > plans["max"].largest
