"""The engine check's reference (bench/engine_reference.py), which dequantizes an export from the
numerics docs/export.md states, against the compressed-tensors library's own decompression of every
quantized weight, for each format the engine check reads; the ModelOpt layout of a format read to
the same weights as its compressed-tensors layout; and its NVFP4 input quantization, element for
element the engine kernel's steps. vLLM is not needed (docs/engine-check.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.engine_reference import (
    InputQuant,
    bf16_steps,
    e2m1,
    e4m3,
    engine_bf16,
    engine_linear,
    fake_quantize,
    jittered_inputs,
    nvfp4_input,
    quantize_dequantize,
    read_export,
    silu_and_mul,
)
from eprt.hf.export import export_hf
from tests.formats_helpers import ct_scheme, decompressed, tiny_checkpoint
from tests.hf_utils import read_hf_tensors

# every quantized Linear's input a multiple of 128 (INT4's and W4A8's groups)
WIDE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32)
# recipe: (the reference's format name, the input quantization its W8A8 kernels get, ModelOpt layout)
FORMATS = {
    "fp8_block": ("FP8 block", ("fp8-dynamic", 128), True),
    "fp8_channel": ("FP8 channel", ("fp8-dynamic", 0), True),
    "nvfp4_a16": ("NVFP4", None, True),
    "int4": ("INT4", ("fp8-dynamic", 0), False),
    "int4_g32": ("INT4", ("fp8-dynamic", 0), False),
    "w4a8": ("INT4", ("fp8-dynamic", 0), False),
    "mxfp8": ("MXFP8", ("mxfp8", 0), True),
    "mxfp4": ("MXFP4", None, False),
}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(eprt checkpoint of the wide tiny Qwen3-MoE, its unquantized export's tensor names, a directory)."""
    d = tmp_path_factory.mktemp("engine_reference")
    _, ck = tiny_checkpoint(d, **WIDE)
    return ck, set(read_hf_tensors(export_hf(ck, str(d / "source"), progress=False))), d


@pytest.mark.parametrize("recipe", sorted(FORMATS))
def test_reference_dequantizes_as_compressed_tensors(model, recipe):
    ck, source_names, d = model
    fmt, inputs, has_modelopt = FORMATS[recipe]
    ct = export_hf(ck, str(d / f"{recipe}-ct"), progress=False, fmt="compressed-tensors", recipe=recipe)
    weights, modules = read_export(ct)
    # a plain checkpoint: the source's tensors, each quantized weight in bf16, no scale left
    assert set(weights) == source_names
    tensors = read_hf_tensors(ct)
    quantized = {n.rpartition(".")[0] for n in tensors if n.endswith((".weight_packed", ".weight_scale"))}
    assert set(modules) == quantized and any(".experts." in m for m in quantized)
    scheme, compressor = ct_scheme(ct)
    for name, m in modules.items():
        assert m.fmt == fmt, name
        assert (m.inputs and (m.inputs.kind, m.inputs.group)) == inputs, name
        library = decompressed(tensors, name, scheme, compressor).to(torch.bfloat16)
        assert torch.equal(weights[f"{name}.weight"], library), name
    if has_modelopt:
        modelopt_weights, modelopt_modules = read_export(
            export_hf(ck, str(d / f"{recipe}-modelopt"), progress=False, recipe=recipe)
        )
        assert set(modelopt_weights) == source_names and set(modelopt_modules) == quantized
        for name, t in weights.items():
            assert torch.equal(modelopt_weights[name], t), name


def engine_nvfp4_element(x: np.float32, amax: np.float32, g: np.float32) -> float:
    """One activation as vLLM's NVFP4 quantization computes it (its emulation's steps, which are its
    CUDA kernel's, cvt_warp_fp16_to_fp4): fp32 products and reciprocals, scalar by scalar."""
    f = np.float32
    block = float(torch.tensor(g * (amax * f(1 / 6))).clamp(max=448).to(torch.float8_e4m3fn).float())
    if block == 0:
        return 0.0
    v = abs(x * (f(1) / (f(block) * (f(1) / g))))
    # E2M1 with cvt.rn's ties, the thresholds of vLLM's cast_to_fp4
    up = [(0.25, 0.5, False), (0.75, 1.0, True), (1.25, 1.5, False), (1.75, 2.0, True), (2.5, 3.0, False)]
    up += [(3.5, 4.0, True), (5.0, 6.0, False)]
    q = 0.0
    for edge, value, tie_up in up:
        if v > edge or (tie_up and v == edge):
            q = value
    return float(f(np.copysign(q, x)) * (f(block) / g))


def test_nvfp4_inputs_round_as_the_engine_does():
    """The reference's NVFP4 activation fake-quantization, element for element the engine's: bf16
    activations on a coarse grid under a bf16 calibrated amax land exactly on E2M1 midpoints, where
    the quotient's fp32 rounding through the reciprocals picks the side."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randint(-96, 97, (64, 64), generator=g).float() / 32).bfloat16()
    in_amax = 3.0
    q = nvfp4_input((torch.tensor(in_amax) / (6 * 448)).item())  # ModelOpt's input_scale, as exported
    got = fake_quantize(x, q)
    f = np.float32
    xs, gs = x.float().numpy(), f(q.global_scale)
    amax = np.abs(xs.reshape(64, -1, 16)).max(-1).repeat(16, -1)
    expected = [engine_nvfp4_element(f(v), f(a), gs) for v, a in zip(xs.flat, amax.flat)]
    assert torch.equal(got, torch.tensor(expected).view(64, 64).bfloat16())
    # the grid does reach midpoints that export.md's division rule rounds the other way
    blocks = x.float().view(64, -1, 16)
    s = e4m3(blocks.abs().amax(-1, keepdim=True) / (6 * q.scale)).clamp(min=2.0**-9) * q.scale
    assert not torch.equal(got, (e2m1(blocks / s) * s).view(64, 64).bfloat16())


def scaled_mm_linear(codes: torch.Tensor, w_codes: torch.Tensor, w_scale: torch.Tensor, x_scale: torch.Tensor):
    """An FP8 Linear on E4M3 inputs in vLLM's torch kernels' steps: torch._scaled_mm per tensor; per
    token, an fp32 product of the E4M3 values scaled by each token's and row's scale after
    (ChannelWiseTorchFP8ScaledMMLinearKernel)."""
    if x_scale.numel() == 1:
        return torch._scaled_mm(codes, w_codes.t(), scale_a=x_scale, scale_b=w_scale, out_dtype=torch.bfloat16)
    one = torch.ones(1)
    y = torch._scaled_mm(codes, w_codes.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
    return (y * x_scale * w_scale.view(1, -1)).to(torch.bfloat16)


@pytest.mark.parametrize("per_token", [False, True])
def test_fp8_linears_compute_as_the_engine_does(per_token):
    """The reference's W8A8 FP8 Linear, output for output torch._scaled_mm's in vLLM's steps: the input
    multiplied by the scale's reciprocal, not divided (they round apart where the quotient lands on an
    E4M3 midpoint), and the E4M3 values multiplied unrounded (rounding input and weight to bf16 first
    moves about half the outputs by a bf16 step)."""
    g = torch.Generator().manual_seed(0)
    # every token's amax A, so its per-token scale is the static one, s = A / 448; the bf16 values
    # whose quotient by s and product with fp32(1 / s) round to different E4M3 values placed in front
    amax = 0.296875
    s = torch.tensor(amax / 448)
    every_bf16 = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    below = every_bf16[every_bf16.abs() < amax]
    apart = below[e4m3(below / s) != e4m3(below * s.reciprocal())]
    x = (torch.rand(64, 128, generator=g) * 2 - 1) * amax
    x[:, 0], x[:, 1 : 1 + len(apart)] = amax, apart
    x = x.bfloat16()
    w_codes = (torch.randn(32, 128, generator=g) * 100).to(torch.float8_e4m3fn)
    w_scale = torch.rand(32 if per_token else 1, generator=g) * 1e-3
    weight = w_codes.float() * w_scale.view(-1, 1)
    x_scale = s.expand(64, 1) if per_token else s.view(1)
    q = InputQuant("fp8-dynamic") if per_token else InputQuant("fp8-static", s.item())
    got = engine_linear(x, weight, q)
    # vLLM's input quantization element for element
    codes = (x.float() * x_scale.reciprocal()).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(quantize_dequantize(x, q, fp8_by_reciprocal=True), codes.float() * x_scale)
    expected = scaled_mm_linear(codes, w_codes, w_scale, x_scale)

    def apart(y):  # mean |y - vLLM's| / mean |vLLM's|
        return ((y.float() - expected.float()).abs().mean() / expected.float().abs().mean()).item()

    # per token the scales multiply after the sum (vLLM) or before it: an fp32 rounding apart, which
    # moves an output by a bf16 step now and then
    assert apart(got) == 0 if not per_token else apart(got) < 2**-12
    # each departure from those steps shows, further off
    by_division = e4m3(x.float() / x_scale) * x_scale
    assert apart(torch.nn.functional.linear(by_division, weight).bfloat16()) > max(4 * apart(got), 2**-12)
    assert apart(torch.nn.functional.linear(fake_quantize(x, q), weight.bfloat16())) > max(4 * apart(got), 2**-12)


def test_the_noise_floors_jitter_moves_half_the_inputs_one_bf16_step():
    """The engine check's noise floor moves every quantized input by one bf16 step on a random half
    of its nonzero elements, and only inside `jittered_inputs`."""
    x = torch.randn(64, 256).to(torch.bfloat16)
    x[0] = 0
    x[1] = -0.0
    q = nvfp4_input(0.05)
    plain = quantize_dequantize(x, q)
    moved = bf16_steps(x, torch.Generator().manual_seed(1))
    up = torch.nextafter(x, torch.tensor(float("inf"), dtype=torch.bfloat16))
    down = torch.nextafter(x, torch.tensor(float("-inf"), dtype=torch.bfloat16))
    changed = moved != x
    assert ((moved == x) | (moved == up) | (moved == down)).all()
    assert not changed[:2].any()  # zeros of either sign stay
    assert 0.45 < changed[2:].float().mean().item() < 0.55
    assert 0.4 < (moved[changed] > x[changed]).float().mean().item() < 0.6  # up and down alike
    with jittered_inputs(0):
        jittered = quantize_dequantize(x, q)
    assert not torch.equal(jittered, plain)
    assert torch.equal(quantize_dequantize(x, q), plain)  # the context restores the plain rule


@pytest.mark.parametrize("avx512_bf16", [True, False])
def test_the_activation_converts_to_bf16_as_vllms_cpu_kernels_do(monkeypatch, avx512_bf16):
    """The reference's gated activation is silu(gate) * up in fp32 converted to bf16 once, as vLLM's
    CPU silu_and_mul converts it: to nearest on a CPU with AVX-512 BF16 (its conversion instruction),
    else toward zero, which differs from rounding to nearest on about half the elements; a product
    that is already a bf16 value is kept either way."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    gate, up = torch.randn(2, 4096), torch.randn(2, 4096)
    got = silu_and_mul(gate.to(torch.bfloat16), up.to(torch.bfloat16))
    exact = torch.nn.functional.silu(gate.to(torch.bfloat16).float()) * up.to(torch.bfloat16).float()
    nearest = exact.to(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    assert torch.equal(silu_and_mul(torch.zeros(3), torch.zeros(3)), torch.zeros(3, dtype=torch.bfloat16))
    representable = torch.tensor([1.0, -2.5, 0.75])
    assert torch.equal(engine_bf16(representable), representable.to(torch.bfloat16))
    if avx512_bf16:
        assert torch.equal(got, nearest)
        return
    g = got.float()
    assert (g.abs() <= exact.abs()).all() and ((g == 0) | (g.sign() == exact.sign())).all()
    away = torch.nextafter(got, (exact.sign() * float("inf")).to(torch.bfloat16)).float()
    assert ((exact - g).abs() < (away - g).abs()).all()  # short of the next bf16 value away from zero
    assert 0.4 < (nearest != got).float().mean().item() < 0.6
