"""Llama-4 under expert parallelism (which ModelOpt does not run): every rank's logits are bitwise the
single-process logits of its batch, over more tokens than a chunk; FP8 and NVFP4 exports of the VLM
are the same bytes at every (world, ep), pass eprt-check against the source, keep the router and the
vision tower as the source held them, and store the routed experts per expert as ModelOpt's layout names them."""

import json
import os

import pytest
import torch

from eprt.hf.check_export import check_export
from tests.ep_checks import (
    LAYOUTS,
    RECIPES,
    assert_ep_logits,
    calibrate_every_layout,
    exports_by_layout,
    same_files,
    tiny_checkpoints,
)
from tests.hf_utils import raw, read_hf_tensors

FAMILY = "llama4"
L = "language_model.model.layers"
# vLLM builds the router unquantized; the vision tower and its projector are carried
NEVER_QUANTIZED = [f"{L}.1.feed_forward.router", f"{L}.2.feed_forward.router", "multi_modal_projector.linear_1"]
QUANTIZED = [
    f"{L}.0.self_attn.q_proj",
    f"{L}.0.feed_forward.down_proj",  # a dense layer's MLP
    f"{L}.1.self_attn.o_proj",
    f"{L}.1.feed_forward.shared_expert.gate_proj",
    f"{L}.2.feed_forward.experts.7.down_proj",
]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp(FAMILY), FAMILY)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_are_bitwise_the_single_process_logits(ckpts, world, ep):
    assert_ep_logits([ckpts["fp32"][1]], world, ep, seq_len=12)  # chunks of 8: two of them


@pytest.mark.timeout(400)
def test_exports_are_the_same_bytes_at_every_layout(ckpts, tmp_path):
    out = str(tmp_path)
    hf, ck = ckpts["bf16"]
    calibrate_every_layout({FAMILY: ck}, out, calib_size=6)
    source = read_hf_tensors(hf)
    for recipe, *_ in RECIPES:
        exports = exports_by_layout(out, FAMILY, recipe)
        ref = exports["w1-ep1"]
        assert check_export(ref, hf) == []
        for layout in LAYOUTS:
            assert same_files(ref, exports[layout]), (recipe, layout)
        exported = read_hf_tensors(ref)
        for module in NEVER_QUANTIZED:
            assert raw(exported[f"{module}.weight"]) == raw(source[f"{module}.weight"]), module
            assert f"{module}.weight_scale" not in exported and f"{module}.input_scale" not in exported
        for module in QUANTIZED:
            assert exported[f"{module}.weight"].dtype == (torch.uint8 if recipe == "nvfp4" else torch.float8_e4m3fn)
            assert f"{module}.weight_scale" in exported, module
        for n in (n for n in source if n.startswith(("vision_model.", "multi_modal_projector."))):
            assert raw(exported[n]) == raw(source[n]) and exported[n].dtype == source[n].dtype, n
        excluded = json.load(open(os.path.join(ref, "hf_quant_config.json")))["quantization"]["exclude_modules"]
        assert f"{L}.1.feed_forward.router" in excluded
