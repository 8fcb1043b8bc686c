"""Every claim an export or a source makes is checked: eprt-check refuses block scales that decode
to a value the engines cannot use (an E8M0 code whose block overflows to inf, an FP8-block grid of one
block holding NaN, 0 or a negative), however small the grid."""

import math

import pytest
import torch

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.formats_helpers import broken_copy, set_first

CT = "compressed-tensors"
# (recipe, layout): MXFP8 and MXFP4 store E8M0 codes, FP8 block an fp32 grid (one block per small Linear)
EXPORTS = [("mxfp8", "modelopt"), ("mxfp4", CT), ("fp8_block", "modelopt")]
Q_PROJ = "model.layers.0.self_attn.q_proj"
EXPERT = "model.layers.0.mlp.experts.0.down_proj"


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    d = tmp_path_factory.mktemp("claims")
    ck = convert_hf(make_tiny("qwen3_moe", str(d / "hf")), str(d / "ck"), progress=False)
    out = {}
    for recipe, layout in EXPORTS:
        q = str(d / recipe)
        run_ptq(ParallelState.single("cpu"), PTQArgs(ck, recipe, q, calib_size=4, seq_len=16, progress=False))
        out[recipe] = export_hf(q, f"{q}-hf", progress=False, fmt=layout)
    return out


def set_code(code: int):
    def edit(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = code
        return t

    return edit


# the smallest code whose block's largest element (448 or 6 times its scale) is inf in fp32, and the
# largest code (its reciprocal, 2^-127, is flushed to zero)
@pytest.mark.parametrize("recipe, code", [("mxfp8", 247), ("mxfp4", 253), ("mxfp8", 254), ("mxfp4", 254)])
def test_an_e8m0_code_whose_block_decodes_to_inf_is_refused(exports, tmp_path, recipe, code):
    assert check_export(exports[recipe]) == []
    name = f"{Q_PROJ}.weight_scale"
    problems = check_export(broken_copy(exports[recipe], tmp_path / "x", name, set_code(code)))
    assert any(p.startswith(f"{name}: {2.0 ** (code - 127):g}") for p in problems), problems


@pytest.mark.parametrize("recipe, code", [("mxfp8", 246), ("mxfp4", 252)])
def test_the_largest_e8m0_code_that_stays_finite_passes(exports, tmp_path, recipe, code):
    name = f"{Q_PROJ}.weight_scale"
    assert check_export(broken_copy(exports[recipe], tmp_path / "x", name, set_code(code))) == []


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_the_all_zero_blocks_code_passes(exports, tmp_path, recipe):
    """E8M0 code 0 (2^-127) is what eprt and ModelOpt write for a block of zeros: anything it can
    encode is below 3e-36, so it means zero and is not a fault."""
    name = f"{Q_PROJ}.weight_scale"
    assert check_export(broken_copy(exports[recipe], tmp_path / "x", name, set_code(0))) == []


@pytest.mark.parametrize("value", [math.nan, 0.0, -1.0, math.inf])
@pytest.mark.parametrize("module", [Q_PROJ, EXPERT])
def test_an_fp8_block_grid_of_one_block_is_checked_like_any_grid(exports, tmp_path, value, module):
    name = f"{module}.weight_scale"
    problems = check_export(broken_copy(exports["fp8_block"], tmp_path / "x", name, set_first(value)))
    assert any(p.startswith(name) and "block scale(s) zero, negative or NaN" in p for p in problems), problems
