"""Qwen3-Next and Qwen3.5-MoE under expert parallelism: every rank's logits are bitwise the
single-process logits of its batch, and FP8 and NVFP4 exports are the same bytes at every
(world, ep), with the modules vLLM builds unquantized left in the source dtype."""

import json
import os
from datetime import timedelta

import pytest
import torch

import eprt
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.hf_utils import raw, read_hf_tensors
from tests.layouts.test_ptq import same_files
from tests.multiproc import free_port, run_world

E = 8
SHAPES = [(2, 6), (1, 5), (3, 4), (0, 7)]  # rank r's batch (sequences, tokens); rank 3 has none
FAMILIES = ["qwen3_next", "qwen3_5_moe"]
# (recipe, kv cache, calibration dtype), as tests/layouts/test_ptq.py
RECIPES = [("fp8", None, "fp32"), ("nvfp4", "fp8", "bf16")]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{family: {dtype: (Hugging Face dir, eprt checkpoint)}}."""
    root = tmp_path_factory.mktemp("qwen_next")
    out = {}
    for family in FAMILIES:
        for dtype in ("fp32", "bf16"):
            hf = make_tiny(family, str(root / f"{family}-hf-{dtype}"), dtype=dtype)
            out.setdefault(family, {})[dtype] = hf, convert_hf(hf, str(root / f"{family}-ck-{dtype}"), progress=False)
    return out


def tokens(rank: int) -> torch.Tensor:
    B, T = SHAPES[rank]
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(rank))


def ep_logits(cks: list[str], ep: int, port: int):
    ids = tokens(int(os.environ["RANK"]))
    os.environ["MASTER_PORT"] = str(port)
    out = []
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        for ck in cks:
            with torch.no_grad():
                want = eprt.load_model(ck, dtype=torch.float32)(ids)
            model = eprt.load_model(ck, dtype=torch.float32, parallel=state)
            with torch.no_grad():
                got = model(ids)
            out.append(
                {
                    "experts": {(b.experts.first, b.experts.count) for _, b in model.moe_blocks()},
                    "shape": (tuple(got.shape), tuple(want.shape)),
                    "bitwise": torch.equal(got, want),
                    "max_diff": (got - want).abs().max().item() if got.numel() else 0.0,
                }
            )
    return out


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_are_bitwise_the_single_process_logits(ckpts, world, ep):
    cks = [ckpts[f]["fp32"][1] for f in FAMILIES]
    results = run_world(ep_logits, world, cks, ep, free_port(), timeout=190)
    for rank, per_family in enumerate(results):
        B, T = SHAPES[rank]
        for family, r in zip(FAMILIES, per_family):
            assert r["shape"] == ((B, T, 512), (B, T, 512))
            assert r["experts"] == {((rank % ep) * E // ep, E // ep)}
            assert r["bitwise"], (family, world, ep, rank, r["max_diff"])


def calibrate(cks: dict[str, str], out_root: str, ep: int, port: int) -> None:
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        for family, ck in cks.items():
            for recipe, kv, dtype in RECIPES:
                run_ptq(
                    state,
                    PTQArgs(
                        ck,
                        recipe,
                        os.path.join(out_root, f"{family}-{recipe}-w{state.world}-ep{ep}"),
                        kv_cache=kv,
                        calib_size=6,
                        seq_len=24,
                        batch_size=2,
                        dtype=dtype,
                        progress=False,
                    ),
                )


# vLLM builds these unquantized (its qwen3_next / qwen3_5 loaders): the router, the shared
# expert's gate, the linear attention's b/a projections; the depthwise conv1d is no Linear.
NEVER_QUANTIZED = {
    "qwen3_next": [
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.shared_expert_gate",
        "model.layers.0.linear_attn.in_proj_ba",
    ],
    "qwen3_5_moe": [
        "model.language_model.layers.0.mlp.gate",
        "model.language_model.layers.0.mlp.shared_expert_gate",
        "model.language_model.layers.0.linear_attn.in_proj_b",
        "model.language_model.layers.0.linear_attn.in_proj_a",
        "model.visual.blocks.0.attn.qkv",
        "model.visual.merger.linear_fc2",
    ],
}
QUANTIZED = {
    "qwen3_next": [
        "model.layers.0.linear_attn.in_proj_qkvz",
        "model.layers.0.linear_attn.out_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.shared_expert.down_proj",
        "model.layers.2.mlp.up_proj",
        "model.layers.3.mlp.experts.7.down_proj",
    ],
    "qwen3_5_moe": [
        "model.language_model.layers.0.linear_attn.in_proj_qkv",
        "model.language_model.layers.0.linear_attn.in_proj_z",
        "model.language_model.layers.0.linear_attn.out_proj",
        "model.language_model.layers.3.self_attn.o_proj",
        "model.language_model.layers.3.mlp.shared_expert.gate_proj",
        "model.language_model.layers.1.mlp.experts.0.gate_proj",
    ],
}
KV_LAYERS = {"qwen3_next": ["model.layers.1", "model.layers.3"], "qwen3_5_moe": ["model.language_model.layers.3"]}


@pytest.mark.timeout(400)
def test_exports_are_the_same_bytes_at_every_layout(ckpts, tmp_path):
    out = str(tmp_path)
    cks = {f: ckpts[f]["bf16"][1] for f in FAMILIES}
    calibrate(cks, out, 1, free_port())
    run_world(calibrate, 2, cks, out, 2, free_port(), timeout=180)
    run_world(calibrate, 4, cks, out, 2, free_port(), timeout=240)
    for family in FAMILIES:
        source = read_hf_tensors(ckpts[family]["bf16"][0])
        for recipe, *_ in RECIPES:
            exports = {
                layout: export_hf(
                    os.path.join(out, f"{family}-{recipe}-{layout}"),
                    os.path.join(out, f"export-{family}-{recipe}-{layout}"),
                    progress=False,
                )
                for layout in ("w1-ep1", "w2-ep2", "w4-ep2")
            }
            ref = exports["w1-ep1"]
            assert check_export(ref, ckpts[family]["bf16"][0]) == []
            for layout in ("w2-ep2", "w4-ep2"):
                assert same_files(ref, exports[layout]), (family, recipe, layout)
            exported = read_hf_tensors(ref)
            for module in NEVER_QUANTIZED[family]:
                assert raw(exported[f"{module}.weight"]) == raw(source[f"{module}.weight"]), module
                assert f"{module}.weight_scale" not in exported and f"{module}.input_scale" not in exported
            for module in QUANTIZED[family]:
                assert exported[f"{module}.weight"].dtype == (torch.uint8 if recipe == "nvfp4" else torch.float8_e4m3fn)
                assert f"{module}.weight_scale" in exported, module
            # conv1d, A_log, dt_bias travel as they are
            for n in (n for n in source if n.endswith(("conv1d.weight", ".A_log", ".dt_bias"))):
                assert raw(exported[n]) == raw(source[n]) and exported[n].dtype == source[n].dtype, n
            kv = sorted(n for n in exported if n.endswith(("k_scale", "v_scale")))
            assert kv == (
                sorted(f"{layer}.self_attn.{p}_proj.{p}_scale" for layer in KV_LAYERS[family] for p in "kv")
                if recipe == "nvfp4"
                else []
            )
            excluded = json.load(open(os.path.join(ref, "hf_quant_config.json")))["quantization"]["exclude_modules"]
            assert excluded, family
