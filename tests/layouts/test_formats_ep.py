"""Every shipped recipe beyond the two the family-wide layout test runs (tests/layouts/test_ptq.py:
fp8, nvfp4) exports the same bytes from two ranks at ep 2 as from one process: each weight format's
scales, codes and export tensors are functions of the weights, never of which rank held an
expert. A new shipped recipe joins by being shipped."""

import filecmp
import os
from datetime import timedelta

import pytest

from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.formats import weight_format
from eprt.quant.recipe import available, load_recipe
from tests.formats_helpers import calibrated_exports, ptq, tiny_checkpoint
from tests.multiproc import run_world

# the layout test's own (tests/layouts/test_ptq.py), and Kimi-K3's release recipe, which only its family runs
COVERED_ELSEWHERE = {"fp8", "nvfp4", "kimi_k3_release"}
RECIPES = [r for r in available() if r not in COVERED_ELSEWHERE]
# every input dim a whole number of INT4's groups of 128 (the fp8_block test takes partial blocks)
SHAPE = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128, "head_dim": 32}


def layout(recipe: str) -> str:
    """The ModelOpt layout where it holds every format of the recipe, else compressed-tensors."""
    modelopt = all(weight_format(f).modelopt_layout for f in load_recipe(recipe).formats)
    return "modelopt" if modelopt else "ct"


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """(the eprt checkpoint, recipe -> its one-process export)."""
    d = tmp_path_factory.mktemp("formats_ep")
    _, ck = tiny_checkpoint(d, **SHAPE)
    return ck, {r: next(e for e in calibrated_exports(ck, str(d / r), r, (layout(r),)) if e) for r in RECIPES}


def _ptq_ep2(ck: str, out_root: str) -> None:
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        for recipe in RECIPES:
            ptq(state, ck, os.path.join(out_root, recipe), recipe)


def test_every_recipe_exports_the_same_bytes_at_ep_2(single, tmp_path):
    assert {"fp8_block", "fp8_channel", "nvfp4_a16", "int4", "w4a8", "mxfp8", "mxfp4"} <= set(RECIPES)
    ck, exports = single
    run_world(_ptq_ep2, 2, ck, str(tmp_path), timeout=600)
    for recipe, reference in exports.items():
        fmt = "modelopt" if layout(recipe) == "modelopt" else "compressed-tensors"
        ours = export_hf(str(tmp_path / recipe), str(tmp_path / f"{recipe}-export"), progress=False, fmt=fmt)
        names = sorted(os.listdir(reference))
        assert names == sorted(os.listdir(ours)), recipe
        for n in names:
            assert filecmp.cmp(os.path.join(reference, n), os.path.join(ours, n), shallow=False), (recipe, n)
