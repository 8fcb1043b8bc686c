"""NVFP4 weights only (`format: nvfp4_a16`) against references nobody here wrote.

- The ModelOpt layout: byte for byte ModelOpt 0.47's `export_hf_checkpoint` of its W4A16_NVFP4
  config on the same model, hf_quant_config.json and config.json's quantization_config included.
- The compressed-tensors layout: the library's NVFP4A16 scheme parses it and its compressor
  decompresses every module to eprt's dequantized values (but for bf16 rounding: the library
  divides by the global scale).
- Its weights are NVFP4's, byte for byte: the same codes and scales as `format: nvfp4` writes,
  without the input scales.
- eprt-check passes both layouts, refuses an input scale in it and a zero block scale.
- The export is the same bytes from two ranks at ep 2 as from one process.
"""

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.formats.nvfp4 import dequantize_nvfp4
from eprt.quant.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.hf_utils import raw, read_hf_tensors
from tests.multiproc import run_world
from tests.test_format_fp8_block import broken_copy

SAMPLES, SEQ_LEN = 2, 16


def ptq(state: ParallelState, ck: str, out: str, recipe: str = "nvfp4_a16") -> None:
    run_ptq(state, PTQArgs(ck, recipe, out, calib_size=SAMPLES, seq_len=SEQ_LEN, batch_size=SAMPLES, progress=False))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(source dir, eprt checkpoint, ModelOpt-layout export, compressed-tensors export, NVFP4 export)."""
    d = tmp_path_factory.mktemp("nvfp4_a16")
    hf = make_tiny("qwen3_moe", str(d / "hf"))
    ck = convert_hf(hf, str(d / "ck"), progress=False)
    q, nvfp4 = str(d / "q"), str(d / "nvfp4")
    ptq(ParallelState.single(), ck, q)
    ptq(ParallelState.single(), ck, nvfp4, "nvfp4")
    return (
        hf,
        ck,
        export_hf(q, q + "-modelopt", progress=False),
        export_hf(q, q + "-ct", progress=False, fmt="compressed-tensors"),
        export_hf(nvfp4, nvfp4 + "-modelopt", progress=False),
    )


def test_the_modelopt_export_is_modelopts(model, tmp_path):
    pytest.importorskip("modelopt")
    pytest.importorskip("transformers")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    hf, _, ours_dir, _, _ = model
    torch_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    # enough tokens that every expert is run (an expert ModelOpt's calibration never ran fails its export)
    tokens = torch.randint(0, 500, (16, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(torch_model, mtq.W4A16_NVFP4_CFG, lambda m: m(tokens))
    export_hf_checkpoint(torch_model, export_dir=str(tmp_path / "modelopt"))
    theirs, ours = read_hf_tensors(str(tmp_path / "modelopt")), read_hf_tensors(ours_dir)
    assert set(theirs) == set(ours)
    assert not any(n.endswith("input_scale") for n in ours)
    for name in sorted(theirs):
        a, b = theirs[name], ours[name]
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert raw(a) == raw(b), name
    for config in ("hf_quant_config.json", "config.json"):
        mine, modelopts = (json.loads(Path(d, config).read_text()) for d in (ours_dir, tmp_path / "modelopt"))
        if config == "config.json":
            mine, modelopts = mine["quantization_config"], modelopts["quantization_config"]
        mine["producer"].pop("exported_by")
        assert mine == modelopts, config


def test_the_weights_are_nvfp4s_without_input_scales(model):
    _, _, ours, _, nvfp4 = model
    a16, full = read_hf_tensors(ours), read_hf_tensors(nvfp4)
    assert set(a16) == {n for n in full if not n.endswith(".input_scale")}
    for name in a16:
        assert raw(a16[name]) == raw(full[name]), name


def test_compressed_tensors_decompresses_to_eprts_values(model):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    _, _, modelopt, ct, _ = model
    qc = QuantizationConfig.model_validate(json.loads(Path(ct, "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    assert scheme.input_activations is None and scheme.weights.group_size == 16
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    theirs, ours = read_hf_tensors(ct), read_hf_tensors(modelopt)
    assert not any(n.endswith("input_global_scale") for n in theirs)
    modules = sorted(n[: -len(".weight_scale_2")] for n in ours if n.endswith(".weight_scale_2"))
    assert any(".experts." in m for m in modules)
    for module in modules:
        state = {
            leaf: theirs[f"{module}.{leaf}"]
            for leaf in compressor.compression_param_names(scheme)
            if f"{module}.{leaf}" in theirs
        }
        weight = compressor.decompress(state, scheme)["weight"]
        expected = dequantize_nvfp4(
            ours[f"{module}.weight"], ours[f"{module}.weight_scale"], ours[f"{module}.weight_scale_2"], torch.bfloat16
        )
        torch.testing.assert_close(weight.to(torch.bfloat16), expected, rtol=2**-7, atol=0, msg=module)


def test_check_passes_both_layouts_and_refuses_faults(model, tmp_path):
    _, _, modelopt, ct, _ = model
    assert check_export(modelopt) == []
    assert check_export(ct) == []
    q = "model.layers.0.self_attn.q_proj"

    def zero_block(t: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(t.view(torch.uint8)).view(t.dtype)

    problems = check_export(broken_copy(modelopt, tmp_path / "a", f"{q}.weight_scale", zero_block))
    assert any(p.startswith(f"{q}.weight_scale") and "zero" in p for p in problems), problems
    problems = check_export(broken_copy(ct, tmp_path / "b", f"{q}.weight_scale", zero_block))
    assert any(p.startswith(f"{q}.weight_scale") and "zero" in p for p in problems), problems


def _ptq_ep2(ck: str, out: str) -> None:
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        ptq(state, ck, out)


def test_two_ranks_at_ep_2_export_the_same_bytes(model, tmp_path):
    _, ck, modelopt, _, _ = model
    run_world(_ptq_ep2, 2, ck, str(tmp_path / "q"), timeout=300)
    ours = export_hf(str(tmp_path / "q"), str(tmp_path / "export"), progress=False)
    names = sorted(os.listdir(modelopt))
    assert names == sorted(os.listdir(ours))
    for n in names:
        assert Path(modelopt, n).read_bytes() == Path(ours, n).read_bytes(), n
