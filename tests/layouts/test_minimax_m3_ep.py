"""MiniMax-M3 under expert parallelism, as released (the vision-language checkpoint) and as
transformers saves its language model: every rank's logits are bitwise the single-process logits of
its batch, and FP8 and NVFP4 exports are the same bytes at every (world, ep), with what the
engines build unquantized (the router, the indexer's projections, the vision tower and projectors)
left as the source holds it."""

import json
import os

import pytest
import torch

from tests.ep_checks import (
    assert_ep_logits,
    assert_family_exports,
    tiny_checkpoints,
)

FAMILIES = ["minimax_m3_vl", "minimax_m3_vl_text"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{family: {dtype: (Hugging Face dir, eprt checkpoint)}}."""
    root = tmp_path_factory.mktemp("minimax_m3")
    return {family: tiny_checkpoints(root / family, family) for family in FAMILIES}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_are_bitwise_the_single_process_logits(ckpts, world, ep):
    # 20 tokens: five blocks of 4, more than the indexer keeps
    assert_ep_logits([ckpts[f]["fp32"][1] for f in FAMILIES], world, ep, seq_len=20)


L = "language_model.model.layers"
NEVER_QUANTIZED = {
    "minimax_m3_vl": [
        f"{L}.1.block_sparse_moe.gate",
        f"{L}.1.self_attn.index_q_proj",
        f"{L}.3.self_attn.index_k_proj",
        "multi_modal_projector.linear_1",
        "patch_merge_mlp.linear_2",
        "vision_tower.vision_model.encoder.layers.0.mlp.fc1",
    ],
    "minimax_m3_vl_text": ["model.layers.2.mlp.gate", "model.layers.1.self_attn.indexer.q_proj"],
}
QUANTIZED = {
    "minimax_m3_vl": [
        f"{L}.0.mlp.gate_proj",
        f"{L}.1.self_attn.q_proj",
        f"{L}.1.block_sparse_moe.shared_experts.down_proj",
        f"{L}.3.block_sparse_moe.experts.7.w3",
    ],
    "minimax_m3_vl_text": [
        "model.layers.0.mlp.gate_up_proj",
        "model.layers.3.self_attn.o_proj",
        "model.layers.1.mlp.shared_experts.gate_up_proj",
        "model.layers.2.mlp.experts.0.gate_proj",
    ],
}


@pytest.mark.timeout(400)
def test_exports_are_the_same_bytes_at_every_layout(ckpts, tmp_path):
    # the router's fp32 weight and correction bias travel as they are
    router = lambda n: n.endswith(("e_score_correction_bias", ".gate.weight"))  # noqa: E731
    for family, _, source, exported, ref in assert_family_exports(
        ckpts, str(tmp_path), NEVER_QUANTIZED, QUANTIZED, router
    ):
        assert all(source[n].dtype == torch.float32 for n in filter(router, source)), family
        excluded = json.load(open(os.path.join(ref, "hf_quant_config.json")))["quantization"]["exclude_modules"]
        assert excluded, family
