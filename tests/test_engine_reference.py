"""The engine check's reference (bench/engine_reference.py), which dequantizes an export from the
numerics docs/export.md states, against the compressed-tensors library's own decompression of every
quantized weight, for each format the engine check reads; the ModelOpt layout of a format read to
the same weights as its compressed-tensors layout; and its NVFP4 input quantization, element for
element the engine kernel's steps. vLLM is not needed (docs/engine-check.md)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bench.engine_reference import e2m1, e4m3, fake_quantize, nvfp4_input, read_export
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
