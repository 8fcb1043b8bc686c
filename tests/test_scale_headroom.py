"""NVFP4's scale headroom (a recipe's `scale_headroom`, ModelOpt's "four over six"): weight_scale_2 is
ModelOpt's own, bit for bit, and the mse search under it, choosing each block's scale among every
E4M3 code, is at most the error of ModelOpt's choice between its two grids (a block's amax mapped
to 6 or to 4) on every block, and below the search without headroom where a block sits at the
tensor's amax. The recipe key reads, writes back and reaches the export."""

import json
import os
from types import SimpleNamespace

import pytest
import torch

from eprt.errors import ConfigError
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.formats.nvfp4 import BLOCK_SIZE, NVFP4, dequantize_nvfp4, nvfp4_headroom_scale, quantize_nvfp4
from eprt.quant.numerics import abs_amax
from eprt.quant.recipe import parse_recipe
from eprt.quant.run.ptq import PTQArgs, run_ptq
from tests.formats_helpers import tiny_checkpoint
from tests.hf_utils import read_hf_tensors

RULES = [{"pattern": "*", "format": "nvfp4_a16", "algorithm": "mse"}]


def weight() -> torch.Tensor:
    """A weight with a few outliers and a few blocks of large values spread evenly: blocks at the
    tensor's amax, which max's grid maps to 6 and the finer grid of 4 fits better, and the rest far below."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(32, 256, generator=g) * 0.02
    w[3, 5], w[10, 100], w[20, 17] = 0.5, -0.45, 0.3
    for row in (7, 12):
        w[row, 32:48] = torch.linspace(-0.5, 0.5, BLOCK_SIZE)[torch.randperm(BLOCK_SIZE, generator=g)]
    return w.bfloat16().float()


def block_errors(w: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    return (q - w).double().square().reshape(*w.shape[:-1], -1, BLOCK_SIZE).sum(-1)


def modelopt_four_over_six(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ModelOpt's weight_scale_2, the per-block squared error of its four-over-six choice): its export's
    block scales (`NVFP4QTensor.get_weights_scaling_factor_from_quantizer`, a static quantizer whose
    block amax its mse calibration multiplied by 1.0 or 1.5) for each grid, each block keeping the
    one of smaller error, as its mse calibration does. (Its calibration itself needs triton, which
    the CPU build here has not: the choice is made the same way on its export's scales.)"""
    nvfp4_tensor = pytest.importorskip("modelopt.torch.quantization.qtensor.nvfp4_tensor")
    amax = abs_amax(w)
    block_amax = w.abs().reshape(*w.shape[:-1], -1, BLOCK_SIZE).amax(-1)
    errors, scale_2 = [], None
    for multiplier in (1.0, 1.5):
        quantizer = SimpleNamespace(
            block_sizes={-1: BLOCK_SIZE, "type": "static", "scale_bits": (4, 3), "four_over_six": True},
            global_amax=amax,
            _amax=block_amax.reshape(-1) * multiplier,
        )
        scale_2 = nvfp4_tensor.NVFP4QTensor.get_weights_scaling_factor_2_from_quantizer(quantizer)
        blocks, _ = nvfp4_tensor.NVFP4QTensor.get_weights_scaling_factor_from_quantizer(quantizer, w, scale_2)
        codes, blocks = quantize_nvfp4(w, scale_2.reshape(()), blocks)
        errors.append(block_errors(w, dequantize_nvfp4(codes, blocks, scale_2.reshape(()))))
    return scale_2.reshape(()), torch.minimum(*errors)


def test_headroom_is_modelopts_four_over_six_and_mse_does_at_least_as_well():
    w = weight()
    theirs_scale_2, theirs = modelopt_four_over_six(w)
    scale_2 = nvfp4_headroom_scale(abs_amax(w))
    assert torch.equal(scale_2, theirs_scale_2.float())
    t = NVFP4.quantize(w, scale_2, mse=True)
    ours = block_errors(w, NVFP4.dequantize(t, torch.float32))
    assert (ours <= theirs).all()
    assert t["weight_scale"].float().max() > 256  # a block mapped below 6: the headroom used
    without = block_errors(w, NVFP4.dequantize(NVFP4.quantize(w, NVFP4.scale(abs_amax(w)), mse=True), torch.float32))
    assert ours.sum() < without.sum()


def test_the_recipe_key_reads_and_writes_back():
    recipe = parse_recipe({"quantize": RULES, "scale_headroom": True}, "r")
    assert recipe.scale_headroom and recipe.to_json()["scale_headroom"] is True
    assert parse_recipe(recipe.to_json(), "r") == recipe
    assert "scale_headroom" not in parse_recipe({"quantize": RULES}, "r").to_json()  # as before when unset
    with pytest.raises(ConfigError, match="scale_headroom 'yes'"):
        parse_recipe({"quantize": RULES, "scale_headroom": "yes"}, "r")


def test_the_export_writes_the_headroom_scale(tmp_path):
    """An mse export with scale_headroom: every weight_scale_2 is its weight's amax / (6 x 256) (a
    fused group's: the largest), every other tensor of a dense Linear as it is decoded."""
    _, ck = tiny_checkpoint(tmp_path)
    path = tmp_path / "headroom.json"
    path.write_text(json.dumps({"name": "headroom", "quantize": RULES, "scale_headroom": True}))
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, str(path), q, calib_size=2, seq_len=8, progress=False))
    out = read_hf_tensors(export_hf(q, str(tmp_path / "x"), progress=False))
    source = read_hf_tensors(os.path.join(tmp_path, "hf"))
    o_proj = "model.layers.0.self_attn.o_proj"
    assert torch.equal(out[f"{o_proj}.weight_scale_2"], nvfp4_headroom_scale(abs_amax(source[f"{o_proj}.weight"])))
    assert max(out[n].float().max().item() for n in out if n.endswith(".weight_scale")) > 256
