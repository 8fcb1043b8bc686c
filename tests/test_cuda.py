"""On a CUDA GPU: the Triton kernels at model sizes against the loops, bitwise batch invariance,
fla's chunk_kda against eprt's chunked KDA, and the whole pipeline on one GPU against the CPU's
export. Every test here is marked `cuda`: `make gpu-check` runs them on a GPU, and without one
tests/conftest.py deselects them. Figures go to the JUnit report through record_property."""

import pytest
import torch
import torch.nn.functional as F

from bench.gpu_pipeline import FAMILIES, checkpoint, compare_exports, cpu_export, gpu_export
from eprt.kernels import combine, grouped_mm, permute
from eprt.kernels.grouped_gemm import grouped_mm_loop
from eprt.kernels.permute import combine_torch, permute_torch
from eprt.models.kda import fla_chunk_kda, kda, kda_chunked, l2norm
from eprt.storage.encodings import dequantize_block_fp8
from tests.test_kernels import TOL, _assert_batch_invariant, _column_major, _misaligned, _offsets

pytestmark = pytest.mark.cuda

DEVICE = "cuda"

# Rows per expert: empty experts, single rows, counts on and around the 64-row tile edge, and
# long runs; at the expert shapes of DeepSeek-V3 (hidden 7168, moe_intermediate 2048) and
# Qwen3-30B-A3B (hidden 2048, moe_intermediate 768), both projections.
COUNTS = [0, 1, 63, 64, 65, 200, 0, 513, 7, 128, 129, 3, 0, 300, 64, 1000]
GEMM_SHAPES = {
    "dsv3_gate_up": (4096, 7168),
    "dsv3_down": (7168, 2048),
    "qwen3_gate_up": (1536, 2048),
    "qwen3_down": (2048, 768),
}


def _problem(N, K, dtype, counts=COUNTS, seed=0):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(sum(counts), K, device=DEVICE, generator=g).to(dtype)
    w = (torch.randn(len(counts), N, K, device=DEVICE, generator=g) / K**0.5).to(dtype)
    return x, w, _offsets(counts, DEVICE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("shape", GEMM_SHAPES)
def test_grouped_mm_matches_loop_at_model_shapes(shape, dtype, record_property):
    x, w, offsets = _problem(*GEMM_SHAPES[shape], dtype)
    y = grouped_mm(x, w, offsets)
    want = grouped_mm_loop(x, w, offsets)
    record_property("max_abs_diff", (y.float() - want.float()).abs().max().item())
    assert y.dtype == dtype and y.shape == want.shape
    torch.testing.assert_close(y.float(), want.float(), **TOL[dtype])


# The weights as a rank may hold them: its own stack, an expert slice starting off a 16-byte
# boundary, or a transposed copy. Each batched result is held to the rows computed alone with
# the plain stack, so a layout that changed the bits would fail here by name.
WEIGHT_VIEWS = {"contiguous": None, "misaligned": [_misaligned], "column_major": [_column_major]}


@pytest.mark.parametrize("view", WEIGHT_VIEWS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("N,K", [(1536, 2048), (2048, 768), (4096, 7168)])
def test_grouped_mm_is_bitwise_batch_invariant_on_gpu(N, K, dtype, view):
    """A row's bits do not depend on its expert's row count nor on its place among them."""
    _assert_batch_invariant(grouped_mm, N, K, dtype, device=DEVICE, weight_views=WEIGHT_VIEWS[view])


def test_permute_and_combine_at_deepseek_size_equal_torch_bitwise():
    """DeepSeek-V3's routing (4096 tokens, top-8 of 256, hidden 7168): the Triton gather and the
    fixed-order fp32 combine give the torch implementations' bits."""
    T, K, D, E = 4096, 8, 7168, 256
    g = torch.Generator(device=DEVICE).manual_seed(0)
    x = torch.randn(T, D, device=DEVICE, generator=g).bfloat16()
    ids = torch.randn(T, E, device=DEVICE, generator=g).topk(K, dim=1).indices
    weights = torch.rand(T, K, device=DEVICE, generator=g)
    x_sorted, counts, order = permute(x, ids, E)
    want_sorted, want_counts, want_order = permute_torch(x, ids, E)
    assert torch.equal(x_sorted, want_sorted) and torch.equal(counts, want_counts) and torch.equal(order, want_order)
    y_sorted = x_sorted * 3
    assert torch.equal(combine(y_sorted, order, weights), combine_torch(y_sorted, order, weights))


# ---------------------------------------------------------------- KDA


def _kda_inputs(gate: str, B=2, T=300, H=4, D=128, seed=0):
    """q, k, v as the short convolutions give them (bf16, after SiLU), and the decay of
    Kimi-Linear (-exp(A_log) * softplus(a + dt_bias)) or Kimi-K3 (lower bound -5)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    q, k, v = (F.silu(torch.randn(B, T, H, D, device=DEVICE, generator=g)).bfloat16() for _ in range(3))
    rate = torch.empty(H, 1, device=DEVICE).uniform_(1.0, 16.0, generator=g)
    a = torch.randn(B, T, H, D, device=DEVICE, generator=g)
    if gate == "kimi_linear":
        decay = -rate * F.softplus(a - 4.0)
    else:
        decay = -5.0 * torch.sigmoid(rate * a)
    beta = torch.sigmoid(torch.randn(B, T, H, device=DEVICE, generator=g))
    return q, k, v, decay, beta


@pytest.mark.parametrize("gate", ["kimi_linear", "kimi_k3"])
def test_fla_chunk_kda_matches_eprt_chunked_kda(gate, record_property):
    assert fla_chunk_kda() is not None, (
        "fla.ops.kda is not importable: install the fla-core wheel (bench/gpu_wheels.txt, docs/gpu-check.md)"
    )
    q, k, v, decay, beta = _kda_inputs(gate)
    got = kda(q, k, v, decay, beta)  # on CUDA, fla's chunk_kda
    want = kda_chunked(l2norm(q) * q.shape[-1] ** -0.5, l2norm(k), v.float(), decay, beta)
    err = (got.float() - want).abs()
    scale = want.abs().max().item()
    record_property("max_abs_diff", err.max().item())
    record_property("max_abs_ref", scale)
    record_property("mean_abs_diff", err.mean().item())
    assert got.dtype == v.dtype and got.shape == v.shape
    # fla keeps bf16 operands in its matmuls; eprt's reference is fp32 throughout.
    torch.testing.assert_close(got.float(), want, rtol=0.02, atol=0.02 * scale)


def test_block_fp8_decodes_on_the_gpu_as_on_the_cpu():
    """DeepSeek-V3's expert weights decoded on the GPU (what a rank copies there is the stored fp8 and
    its scales) are the CPU's bit for bit, whole and partial blocks."""
    torch.manual_seed(0)
    for rows, cols in ((4096, 7168), (7168, 2048), (200, 300)):
        w = (torch.randn(2, rows, cols) * 4).to(torch.float8_e4m3fn)
        scale_inv = torch.rand(2, -(-rows // 128), -(-cols // 128)) + 1e-3
        on_gpu = dequantize_block_fp8(w.to(DEVICE), scale_inv.to(DEVICE))
        assert on_gpu.device.type == "cuda"
        assert torch.equal(on_gpu.cpu().view(torch.int16), dequantize_block_fp8(w, scale_inv).view(torch.int16))


# ---------------------------------------------------------------- the pipeline on one GPU


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_on_one_gpu_exports_the_cpu_weights(family, tmp_path, record_property):
    """make_tiny, convert, tools/ptq.py under torchrun on GPU 0 (NVFP4, FP8 KV cache), export;
    the same on the CPU; every tensor name on both sides, weights and weight scales bit for bit,
    activation scales within bench/gpu_pipeline.py's tolerance."""
    ck = checkpoint(family, str(tmp_path))
    figures = compare_exports(cpu_export(ck, str(tmp_path)), gpu_export(ck, str(tmp_path)))
    for name, value in figures.items():
        record_property(name, value)
    assert figures["bitwise_equal"] > 0 and figures["activation_scales"] > 0
