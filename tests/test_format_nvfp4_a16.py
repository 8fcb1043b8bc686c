"""NVFP4 weights only (`format: nvfp4_a16`) against references nobody here wrote.

- The ModelOpt layout: byte for byte ModelOpt 0.47's `export_hf_checkpoint` of its W4A16_NVFP4
  config on the same model, hf_quant_config.json and config.json's quantization_config included.
- The compressed-tensors layout: the library's NVFP4A16 scheme parses it and its compressor
  decompresses every module to eprt's dequantized values (but for bf16 rounding: the library
  divides by the global scale).
- Its weights are NVFP4's, byte for byte: the same codes and scales as `format: nvfp4` writes,
  without the input scales.
- eprt-check passes both layouts, refuses an input scale in it and a zero block scale.
"""

import json
from pathlib import Path

import pytest
import torch

from eprt.hf.check_export import check_export
from eprt.quant.formats.nvfp4 import dequantize_nvfp4
from tests.formats_helpers import (
    broken_copy,
    ct_scheme,
    decompressed,
    export_format,
    modelopt_export,
    quant_config,
)
from tests.hf_utils import raw, read_hf_tensors


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return export_format(tmp_path_factory.mktemp("nvfp4_a16"), "nvfp4_a16")


@pytest.fixture(scope="module")
def nvfp4(tmp_path_factory):
    """The same model's export under `format: nvfp4` (ModelOpt layout)."""
    return export_format(tmp_path_factory.mktemp("nvfp4"), "nvfp4", layouts=("modelopt",)).modelopt


def test_the_modelopt_export_is_modelopts(model, tmp_path):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    theirs_dir = modelopt_export(model.hf, mtq.W4A16_NVFP4_CFG, tmp_path / "modelopt")
    theirs, ours = read_hf_tensors(theirs_dir), read_hf_tensors(model.modelopt)
    assert set(theirs) == set(ours)
    assert not any(n.endswith("input_scale") for n in ours)
    for name in sorted(theirs):
        a, b = theirs[name], ours[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert raw(a) == raw(b), name
    hf_quant = (json.loads(Path(d, "hf_quant_config.json").read_text()) for d in (model.modelopt, theirs_dir))
    for mine, modelopts in (hf_quant, (quant_config(d, "config.json") for d in (model.modelopt, theirs_dir))):
        mine["producer"].pop("exported_by")
        assert mine == modelopts


def test_the_weights_are_nvfp4s_without_input_scales(model, nvfp4):
    a16, full = read_hf_tensors(model.modelopt), read_hf_tensors(nvfp4)
    assert set(a16) == {n for n in full if not n.endswith(".input_scale")}
    for name in a16:
        assert raw(a16[name]) == raw(full[name]), name


def test_compressed_tensors_decompresses_to_eprts_values(model):
    scheme, compressor = ct_scheme(model.ct)
    assert scheme.input_activations is None and scheme.weights.group_size == 16
    theirs, ours = read_hf_tensors(model.ct), read_hf_tensors(model.modelopt)
    assert not any(n.endswith("input_global_scale") for n in theirs)
    modules = sorted(n[: -len(".weight_scale_2")] for n in ours if n.endswith(".weight_scale_2"))
    assert any(".experts." in m for m in modules)
    for module in modules:
        weight = decompressed(theirs, module, scheme, compressor)
        expected = dequantize_nvfp4(
            ours[f"{module}.weight"], ours[f"{module}.weight_scale"], ours[f"{module}.weight_scale_2"], torch.bfloat16
        )
        torch.testing.assert_close(weight.to(torch.bfloat16), expected, rtol=2**-7, atol=0, msg=module)


def test_check_passes_both_layouts_and_refuses_faults(model, tmp_path):
    assert check_export(model.modelopt) == []
    assert check_export(model.ct) == []
    q = "model.layers.0.self_attn.q_proj"

    def zero_block(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t.view(torch.uint8)).view(t.dtype)

    for layout in ("modelopt", "ct"):
        problems = check_export(broken_copy(getattr(model, layout), tmp_path / layout, f"{q}.weight_scale", zero_block))
        assert any(p.startswith(f"{q}.weight_scale") and "zero" in p for p in problems), (layout, problems)
