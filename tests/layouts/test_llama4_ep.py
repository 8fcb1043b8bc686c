"""Llama-4 under expert parallelism (which ModelOpt does not run): every rank's logits are bitwise the
single-process logits of its batch, over more tokens than a chunk; FP8 and NVFP4 exports of the VLM
are the same bytes at every (world, ep), pass eprt-check against the source, keep the router and the
vision tower as the source held them, and store the routed experts per expert as ModelOpt's layout names them."""

import json
import os

import pytest

from tests.ep_checks import (
    assert_ep_logits,
    assert_family_exports,
    tiny_checkpoints,
)

FAMILY = "llama4"
L = "language_model.model.layers"
# vLLM builds the router unquantized; the vision tower and its projector are carried
NEVER_QUANTIZED = [f"{L}.1.feed_forward.router", "multi_modal_projector.linear_1"]
QUANTIZED = [  # the tiny model interleaves as Maverick does: layer 1 MoE, layers 0 and 2 dense
    f"{L}.0.self_attn.q_proj",
    f"{L}.0.feed_forward.down_proj",  # a dense layer's MLP
    f"{L}.1.self_attn.o_proj",
    f"{L}.1.feed_forward.shared_expert.gate_proj",
    f"{L}.1.feed_forward.experts.7.down_proj",
    f"{L}.2.feed_forward.gate_proj",
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
    vision = lambda n: n.startswith(("vision_model.", "multi_modal_projector."))  # noqa: E731
    for *_, ref in assert_family_exports(
        {FAMILY: ckpts}, str(tmp_path), {FAMILY: NEVER_QUANTIZED}, {FAMILY: QUANTIZED}, vision
    ):
        excluded = json.load(open(os.path.join(ref, "hf_quant_config.json")))["quantization"]["exclude_modules"]
        assert f"{L}.1.feed_forward.router" in excluded
