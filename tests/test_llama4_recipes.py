"""Every shipped recipe on Llama-4's VLM (its wide tiny model: every Linear's input a whole number of
each format's blocks): it calibrates, exports in the layout that holds it, and the export passes
eprt-check against the source, the router and the vision tower as the source held them."""

import pytest

from bench.export_digests import wide
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.recipe import available
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.hf_utils import raw, read_hf_tensors

ROUTER = "language_model.model.layers.1.feed_forward.router.weight"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("llama4_recipes")
    hf = make_tiny("llama4", str(d / "hf"), **wide("llama4"))
    return hf, convert_hf(hf, str(d / "ck"), progress=False), read_hf_tensors(hf)


@pytest.mark.parametrize("recipe", available())
def test_every_shipped_recipe_exports_and_passes_the_check(source, recipe, tmp_path):
    hf, ck, tensors = source
    run_ptq(ParallelState.single(), PTQArgs(ck, recipe, str(tmp_path / "q"), calib_size=2, seq_len=16, progress=False))
    out = export_hf(str(tmp_path / "q"), str(tmp_path / "out"), progress=False)
    assert check_export(out, hf) == []
    exported = read_hf_tensors(out)
    kept = [n for n in tensors if n == ROUTER or n.startswith(("vision_model.", "multi_modal_projector."))]
    assert len(kept) == 8
    for n in kept:
        assert raw(exported[n]) == raw(tensors[n]) and exported[n].dtype == tensors[n].dtype, n
    assert any(n.endswith(".weight_scale") for n in exported)  # something is quantized
