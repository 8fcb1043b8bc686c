"""FP8 per channel (`format: fp8_channel`) against references nobody here wrote.

- The numerics: ModelOpt's export quantizer (`to_quantized_weight` of FP8_PC_PT, which divides a
  weight by its row scales) gives eprt's codes, for a weight and for a stack of experts.
- The ModelOpt layout: byte for byte ModelOpt 0.47's `export_hf_checkpoint` of its
  FP8_PER_CHANNEL_PER_TOKEN config on the same model, and the same hf_quant_config.json; its
  config.json names the format with no config_groups (its per-layer table has none for it), where
  eprt adds the channel and per-token arguments.
- The compressed-tensors layout: the library's compressor decompresses every module to eprt's
  dequantized values exactly and its quantizer, given eprt's row scales, encodes the source weights
  to eprt's codes; transformers loads it on CPU with every quantized weight, routed experts
  included, equal to eprt's dequantization.
- eprt-check passes both layouts and refuses a zero, a NaN, a subnormal and a misshapen scale in each.
"""

import pytest
import torch

from eprt.hf.check_export import check_export
from eprt.quant.formats.fp8_channel import dequantize_fp8_channel, fp8_channel_scales, quantize_fp8_channel
from tests.formats_helpers import (
    assert_transformers_loads,
    broken_copy,
    ct_scheme,
    decompressed,
    export_format,
    modelopt_export,
    quant_config,
    set_first,
)
from tests.hf_utils import raw, read_hf_tensors


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return export_format(tmp_path_factory.mktemp("fp8_channel"), "fp8_channel")


def test_the_numerics_are_modelopts_export_quantizer():
    quant_utils = pytest.importorskip("modelopt.torch.export.quant_utils")
    w = torch.randn(2, 200, 300, generator=torch.Generator().manual_seed(0)).bfloat16()
    w[1, 7] = 0  # a zero row: scale 1, codes 0
    scales = fp8_channel_scales(w)
    codes = quantize_fp8_channel(w, scales)
    assert scales.shape == (2, 200) and scales[1, 7] == 1.0
    assert torch.equal(scales[0], w[0].float().abs().amax(dim=-1) / 448)  # ModelOpt's amax / maxbound
    stacked = quant_utils.to_quantized_weight(w, scales, quant_utils.QUANTIZATION_FP8_PC_PT)
    assert raw(stacked) == raw(codes)
    for e in range(2):
        assert raw(quant_utils.to_quantized_weight(w[e], scales[e], quant_utils.QUANTIZATION_FP8_PC_PT)) == raw(
            codes[e]
        )
    assert torch.equal(dequantize_fp8_channel(codes, scales), codes.float() * scales[..., None])


def test_the_modelopt_export_is_modelopts(model, tmp_path):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    theirs_dir = modelopt_export(model.hf, mtq.FP8_PER_CHANNEL_PER_TOKEN_CFG, tmp_path / "modelopt")
    theirs, ours = read_hf_tensors(theirs_dir), read_hf_tensors(model.modelopt)
    assert set(theirs) == set(ours)
    for name in sorted(theirs):
        a, b = theirs[name], ours[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert raw(a) == raw(b), name
    assert quant_config(theirs_dir, "hf_quant_config.json") == quant_config(model.modelopt, "hf_quant_config.json")


def test_compressed_tensors_decompresses_and_encodes_as_eprt(model):
    scheme, compressor = ct_scheme(model.ct)
    from compressed_tensors.quantization.lifecycle.forward import quantize

    assert scheme.weights.strategy == "channel"
    assert (scheme.input_activations.strategy, scheme.input_activations.dynamic) == ("token", True)
    t, source = read_hf_tensors(model.ct), read_hf_tensors(model.hf)
    modules = sorted(n[: -len(".weight_scale")] for n in t if n.endswith(".weight_scale"))
    assert any(".experts." in m for m in modules) and any("self_attn" in m for m in modules)
    for module in modules:
        codes, scales = t[f"{module}.weight"], t[f"{module}.weight_scale"]
        assert torch.equal(scales[:, 0], fp8_channel_scales(source[f"{module}.weight"])), module
        assert torch.equal(
            decompressed(t, module, scheme, compressor).float(), dequantize_fp8_channel(codes, scales[:, 0])
        ), module
        theirs = quantize(
            source[f"{module}.weight"], scales, torch.zeros_like(scales), scheme.weights, dtype=torch.float8_e4m3fn
        )
        assert raw(theirs) == raw(codes), module


def test_transformers_loads_eprts_values(model):
    t = read_hf_tensors(model.ct)

    def eprt_value(module: str) -> torch.Tensor:
        return dequantize_fp8_channel(t[f"{module}.weight"], t[f"{module}.weight_scale"][:, 0], torch.bfloat16)

    assert_transformers_loads(model.ct, eprt_value)


def test_check_passes_both_layouts(model):
    assert check_export(model.modelopt) == []
    assert check_export(model.ct) == []


@pytest.mark.parametrize("layout", ["modelopt", "ct"])
@pytest.mark.parametrize(
    "edit, fault",
    [
        (set_first(0.0), "block scale(s) zero, negative or NaN"),
        (set_first(float("nan")), "block scale(s) zero, negative or NaN"),
        (set_first(1e-40), "subnormal"),
        (lambda t: t[:3].contiguous(), "expected"),  # no format's shape: [3] ([3, 1]) for 64 rows
    ],
)
def test_check_refuses_a_corrupted_scale(model, tmp_path, layout, edit, fault):
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    problems = check_export(broken_copy(getattr(model, layout), tmp_path / "x", name, edit))
    assert any(p.startswith(name) and fault in p for p in problems), problems
