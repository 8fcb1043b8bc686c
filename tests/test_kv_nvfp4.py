"""`--kv-cache nvfp4`: the NVFP4 KV cache as ModelOpt 0.47 writes it.

- The ModelOpt layout: ModelOpt's own export of the same model with its NVFP4 KV-cache config
  (`NVFP4_KV_CFG`, FP8 weights) has the same tensors byte for byte, k_scale and v_scale (amax / 448,
  as ModelOpt defines the KV scale for FP8 and NVFP4 alike) within 1% (two forward implementations
  in bf16), and the same configs: `kv_cache_quant_algo: NVFP4`, config.json's `kv_cache_scheme: "NVFP4"`.
- eprt-check passes it and names a broken k_scale.
- The compressed-tensors layout, which has no NVFP4 KV-cache scheme, is refused by name, and so is a
  model whose cached heads do not fill NVFP4's blocks of 16.
"""

import json
from pathlib import Path

import pytest
import torch

from eprt.errors import ConfigError
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.quant.formats.kv import kv_cache_format
from eprt.testing.tiny import make_tiny
from tests.test_format_fp8_block import broken_copy, set_first

oracle = pytest.importorskip("tests.oracles.test_modelopt_oracle")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(source dir, its config, eprt's calibrated checkpoint, its ModelOpt-layout export) with FP8 weights."""
    d = tmp_path_factory.mktemp("kv_nvfp4")
    hf = make_tiny("qwen3_moe", str(d / "hf"))
    ck = convert_hf(hf, str(d / "ck"), progress=False)
    out = oracle.eprt_export(ck, "fp8", "nvfp4", str(d / "q"))
    return hf, json.loads(Path(hf, "config.json").read_text()), str(d / "q"), out


def test_the_export_is_modelopts(model, tmp_path):
    hf, config, _, out = model
    oracle.compare_with_modelopt(hf, config, "fp8", "nvfp4", out, tmp_path)
    assert json.loads(Path(out, "hf_quant_config.json").read_text())["quantization"]["kv_cache_quant_algo"] == "NVFP4"
    assert json.loads(Path(out, "config.json").read_text())["quantization_config"]["kv_cache_scheme"] == "NVFP4"


def test_check_passes_it_and_names_a_broken_k_scale(model, tmp_path):
    out = model[3]
    assert check_export(out) == []
    name = "model.layers.0.self_attn.k_proj.k_scale"
    problems = check_export(broken_copy(out, tmp_path / "x", name, set_first(0.0)))
    assert any(p.startswith(name) and "finite and positive" in p for p in problems), problems


def test_the_compressed_tensors_layout_is_refused_by_name(model, tmp_path):
    with pytest.raises(ConfigError, match=r"--kv-cache nvfp4, which the compressed-tensors layout has no KV-cache"):
        export_hf(model[2], str(tmp_path / "ct"), progress=False, fmt="compressed-tensors")
    assert not (tmp_path / "ct").exists()


def test_heads_that_do_not_fill_blocks_of_16_are_refused_by_name():
    kv = kv_cache_format("nvfp4")
    keys = torch.randn(1, 2, 4, 32, dtype=torch.bfloat16)
    assert kv.fake_quantize(keys, kv.scale(keys.abs().amax())).shape == keys.shape
    with pytest.raises(ValueError, match=r"blocks of 16 along the head dim, and this model caches heads of 24"):
        kv.fake_quantize(keys[..., :24], kv.scale(1.0))
