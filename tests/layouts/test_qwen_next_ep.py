"""Qwen3-Next and Qwen3.5-MoE under expert parallelism: every rank's logits are bitwise the
single-process logits of its batch, and FP8 and NVFP4 exports are the same bytes at every
(world, ep), with the modules vLLM builds unquantized left in the source dtype."""

import json
import os

import pytest

from tests.ep_checks import (
    assert_ep_logits,
    assert_family_exports,
    tiny_checkpoints,
)

FAMILIES = ["qwen3_next", "qwen3_5_moe"]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """{family: {dtype: (Hugging Face dir, eprt checkpoint)}}."""
    root = tmp_path_factory.mktemp("qwen_next")
    return {family: tiny_checkpoints(root / family, family) for family in FAMILIES}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_are_bitwise_the_single_process_logits(ckpts, world, ep):
    assert_ep_logits([ckpts[f]["fp32"][1] for f in FAMILIES], world, ep)


# vLLM builds these unquantized (its qwen3_next / qwen3_5 loaders): the router, the shared
# expert's gate, the linear attention's b/a projections; the depthwise conv1d is no Linear.
NEVER_QUANTIZED = {
    "qwen3_next": [
        "model.layers.0.mlp.gate",
        "model.layers.0.mlp.shared_expert_gate",
        "model.layers.0.linear_attn.in_proj_ba",
    ],
    "qwen3_5_moe": [
        "model.language_model.layers.0.mlp.gate",
        "model.language_model.layers.0.mlp.shared_expert_gate",
        "model.language_model.layers.0.linear_attn.in_proj_b",
        "model.language_model.layers.0.linear_attn.in_proj_a",
        "model.visual.blocks.0.attn.qkv",
        "model.visual.merger.linear_fc2",
    ],
}
QUANTIZED = {
    "qwen3_next": [
        "model.layers.0.linear_attn.in_proj_qkvz",
        "model.layers.0.linear_attn.out_proj",
        "model.layers.1.self_attn.q_proj",
        "model.layers.1.mlp.shared_expert.down_proj",
        "model.layers.2.mlp.up_proj",
        "model.layers.3.mlp.experts.7.down_proj",
    ],
    "qwen3_5_moe": [
        "model.language_model.layers.0.linear_attn.in_proj_qkv",
        "model.language_model.layers.0.linear_attn.in_proj_z",
        "model.language_model.layers.0.linear_attn.out_proj",
        "model.language_model.layers.3.self_attn.o_proj",
        "model.language_model.layers.3.mlp.shared_expert.gate_proj",
        "model.language_model.layers.1.mlp.experts.0.gate_proj",
    ],
}
KV_LAYERS = {"qwen3_next": ["model.layers.1", "model.layers.3"], "qwen3_5_moe": ["model.language_model.layers.3"]}


@pytest.mark.timeout(400)
def test_exports_are_the_same_bytes_at_every_layout(ckpts, tmp_path):
    # conv1d, A_log, dt_bias travel as they are
    linear_attention_state = lambda n: n.endswith(("conv1d.weight", ".A_log", ".dt_bias"))  # noqa: E731
    exports = assert_family_exports(ckpts, str(tmp_path), NEVER_QUANTIZED, QUANTIZED, linear_attention_state)
    for family, recipe, _, exported, ref in exports:
        kv = sorted(n for n in exported if n.endswith(("k_scale", "v_scale")))
        assert kv == (
            sorted(f"{layer}.self_attn.{p}_proj.{p}_scale" for layer in KV_LAYERS[family] for p in "kv")
            if recipe == "nvfp4"
            else []
        )
        excluded = json.load(open(os.path.join(ref, "hf_quant_config.json")))["quantization"]["exclude_modules"]
        assert excluded, family
