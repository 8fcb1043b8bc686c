"""Kimi-K3 expert parallel: every rank's logits equal the single-process logits of its batch, and a
PTQ export is the same bytes at every (world, ep), with K3's never-quantized modules excluded and
left in the source dtype."""

import filecmp
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
from tests.multiproc import free_port, run_world

E = 8
SHAPES = [(2, 6), (1, 5), (3, 4), (0, 7)]  # rank r's batch (sequences, tokens); rank 3 has none


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    """{dtype: (Hugging Face dir, eprt checkpoint)} of one tiny Kimi-K3."""
    root = tmp_path_factory.mktemp("k3")
    out = {}
    for dtype in ("fp32", "bf16"):
        hf = make_tiny("kimi_k3", str(root / f"hf-{dtype}"), dtype=dtype)
        out[dtype] = hf, convert_hf(hf, str(root / f"ck-{dtype}"), progress=False)
    return out


def tokens(rank: int) -> torch.Tensor:
    B, T = SHAPES[rank]
    return torch.randint(0, 512, (B, T), generator=torch.Generator().manual_seed(rank))


def ep_logits(ck: str, ep: int, port: int):
    ids = tokens(int(os.environ["RANK"]))
    with torch.no_grad():
        want = eprt.load_model(ck, dtype=torch.float32)(ids)
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        model = eprt.load_model(ck, dtype=torch.float32, parallel=state)
        with torch.no_grad():
            got = model(ids)
        experts = {(b.experts.first, b.experts.count) for _, b in model.moe_blocks()}
    return {
        "experts": experts,
        "shape": (tuple(got.shape), tuple(want.shape)),
        "close": torch.allclose(got, want, rtol=1e-5, atol=1e-6),
        "max_diff": (got - want).abs().max().item() if got.numel() else 0.0,
    }


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_k3_expert_parallel_logits(k3, world, ep):
    results = run_world(ep_logits, world, k3["fp32"][1], ep, free_port(), timeout=140)
    for rank, r in enumerate(results):
        B, T = SHAPES[rank]
        assert r["shape"] == ((B, T, 512), (B, T, 512))
        assert r["experts"] == {((rank % ep) * E // ep, E // ep)}
        assert r["close"], (world, ep, rank, r["max_diff"])


def calibrate(ck: str, out_root: str, ep: int, port: int) -> None:
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        run_ptq(
            state,
            PTQArgs(
                ck,
                "nvfp4",
                os.path.join(out_root, f"w{state.world}-ep{ep}"),
                kv_cache="fp8",
                calib_size=6,
                seq_len=24,
                batch_size=2,
                progress=False,
            ),
        )


def same_files(a: str, b: str) -> bool:
    names = sorted(os.listdir(a))
    return names == sorted(os.listdir(b)) and all(
        filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False) for n in names
    )


@pytest.mark.timeout(300)
def test_k3_ptq_export_is_the_same_bytes_at_every_layout(k3, tmp_path):
    hf, ck = k3["bf16"]
    out = str(tmp_path)
    run_ptq(
        ParallelState.single(),
        PTQArgs(
            ck,
            "nvfp4",
            os.path.join(out, "w1-ep1"),
            kv_cache="fp8",
            calib_size=6,
            seq_len=24,
            batch_size=2,
            progress=False,
        ),
    )
    run_world(calibrate, 2, ck, out, 2, free_port(), timeout=120)
    run_world(calibrate, 4, ck, out, 2, free_port(), timeout=160)
    exports = {
        layout: export_hf(os.path.join(out, layout), os.path.join(out, f"export-{layout}"), progress=False)
        for layout in ("w1-ep1", "w2-ep2", "w4-ep2")
    }
    ref = exports["w1-ep1"]
    assert check_export(ref) == []
    for layout in ("w2-ep2", "w4-ep2"):
        assert same_files(ref, exports[layout]), layout

    excluded = json.load(open(os.path.join(ref, "hf_quant_config.json")))["quantization"]["exclude_modules"]
    lm = "language_model.model.layers"
    never_quantized = [
        f"{lm}.1.block_sparse_moe.routed_expert_down_proj",
        f"{lm}.1.block_sparse_moe.routed_expert_up_proj",
        f"{lm}.0.self_attention_res_proj",
        f"{lm}.3.mlp_res_proj",
        "language_model.model.output_attn_res_proj",
    ]
    assert set(never_quantized) | {"vision_tower.*", "mm_projector.*"} <= set(excluded)
    source, exported = read_hf_tensors(hf), read_hf_tensors(ref)
    for module in never_quantized:
        assert raw(exported[f"{module}.weight"]) == raw(source[f"{module}.weight"]), module
        assert exported[f"{module}.weight"].dtype == torch.bfloat16
        assert f"{module}.weight_scale" not in exported and f"{module}.input_scale" not in exported
    vision = [n for n in source if n.startswith(("vision_tower.", "mm_projector."))]
    assert vision and all(exported[n].dtype == source[n].dtype and raw(exported[n]) == raw(source[n]) for n in vision)
    # KV-cache scales on the MLA layer (2) only: KDA layers keep a recurrent state, not a KV cache
    kv = sorted(n for n in exported if n.endswith(("k_scale", "v_scale")))
    assert kv == [f"{lm}.2.self_attn.k_proj.k_scale", f"{lm}.2.self_attn.v_proj.v_scale"]
    # the routed experts keep Kimi's names, quantized
    assert exported[f"{lm}.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.uint8
    assert f"{lm}.1.block_sparse_moe.experts.7.w2.weight_scale_2" in exported
