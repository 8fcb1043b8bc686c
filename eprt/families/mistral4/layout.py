"""Mistral-Small-4's tensors, as released and as transformers 5.25 saves them (the same names):
DeepSeek-V3's MLA in every layer; a dense MLP in the first `first_k_dense_replace` layers, else
a router without correction bias, the routed experts held fused (`experts.gate_up_proj`
[E, 2I, D], `experts.down_proj` [E, D, I]; per expert also read) and the shared experts."""

from __future__ import annotations

import dataclasses

from eprt.config import ModelConfig
from eprt.families.kimi_k25 import layout as kimi_k25
from eprt.layout import Layout, gated_mlp, mla_attention, plain, stacked_experts

# the release's vision tower and projector: carried through, not modeled
VISION = (r"vision_tower\..+", r"multi_modal_projector\..+")


def mlp(p: str, c: ModelConfig, i: int) -> list:
    D, m = c.hidden_size, c.moe
    if not c.is_moe(i):
        return gated_mlp(f"{p}.mlp", D, c.intermediate_size)
    specs = [plain(f"{p}.mlp.gate.weight", m.num_experts, D)]
    specs += stacked_experts(
        f"{p}.mlp.experts", m.num_experts, m.intermediate_size, D, "gate_proj", "up_proj", "down_proj"
    )
    return specs + gated_mlp(f"{p}.mlp.shared_experts", D, m.intermediate_size * m.num_shared_experts)


def layout(c: ModelConfig) -> Layout:
    D = c.hidden_size
    specs = [plain("model.embed_tokens.weight", c.vocab_size, D)]
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        specs += [plain(f"{p}.input_layernorm.weight", D), plain(f"{p}.post_attention_layernorm.weight", D)]
        specs += mla_attention(f"{p}.self_attn", c) + mlp(p, c, i)
    specs.append(plain("model.norm.weight", D))
    if not c.tie_word_embeddings:
        specs.append(plain("lm_head.weight", c.vocab_size, D))
    return Layout(tuple(specs))


def vlm_layout(c: ModelConfig) -> Layout:
    """The release's tensors, as transformers' Mistral3ForConditionalGeneration saves them too: the
    language model's under `language_model.` (`language_model.model.layers.N`,
    `language_model.lm_head`), the vision tower and the projector carried."""
    return dataclasses.replace(kimi_k25.vlm_layout(layout(c)), passthrough=VISION)
