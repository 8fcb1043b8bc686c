"""The quality report and the preview compute with the export's weights: every quantized weight of
eprt's fake-quantized model (eprt.quant.preview.fake_quantize) is, value for value, what the
compressed-tensors library decompresses from the export, routed experts included, for the formats
whose scales come from the weights alone, under max and under mse (each block's scale searched).
The tiny Qwen3-MoE's expert width, 64, is half a block of FP8 block's 128 rows: gate and up are
blocked apart, as the export and the releases block them."""

import pytest
import torch

from tests.formats_helpers import calibrated_exports, ct_scheme, decompressed, fake_quantized_model, tiny_checkpoint
from tests.hf_utils import read_hf_tensors

# NVFP4's decompression divides by the global scale where the engines multiply by its reciprocal,
# so single values round apart: tests/oracles/test_format_logits.py bounds the difference
RECIPES = ["fp8_block", "fp8_channel", "mxfp8", "mxfp4"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory.mktemp("fake_quantized"))


@pytest.mark.parametrize("algorithm", ["max", "mse"])
@pytest.mark.parametrize("recipe", RECIPES)
def test_every_quantized_weight_is_the_libraries_decompression(tiny, recipe, algorithm, tmp_path):
    _, ck = tiny
    _, ct = calibrated_exports(ck, str(tmp_path / "q"), recipe, ("ct",), algorithm)
    model, _, _, undo = fake_quantized_model(ck, str(tmp_path / "q"), torch.float32)
    undo()
    scheme, compressor = ct_scheme(ct)
    tensors = read_hf_tensors(ct)
    quantized = sorted(n.removesuffix(".weight_scale") for n in tensors if n.endswith(".weight_scale"))
    assert any(".experts." in m for m in quantized) and any(".experts." not in m for m in quantized)
    for module in quantized:
        theirs = decompressed(tensors, module, scheme, compressor).float()
        if ".experts." in module:
            moe, e, proj = module.rsplit(".", 2)
            experts = model.get_submodule(moe)
            width = experts.w13.shape[1] // 2
            held = {
                "gate_proj": experts.w13[int(e), :width],
                "up_proj": experts.w13[int(e), width:],
                "down_proj": experts.w2[int(e)],
            }[proj]
        else:
            held = model.get_submodule(module).weight
        assert torch.equal(held.detach(), theirs), (recipe, algorithm, module)
