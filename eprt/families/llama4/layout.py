"""Llama-4's tensors: `model.layers.N.{self_attn, feed_forward}` with the routed experts stored fused and
transposed as released and as transformers saves them (`feed_forward.experts.gate_up_proj` [E, D, 2I],
gate columns then up columns, `down_proj` [E, I, D]), or per expert (`feed_forward.experts.E.gate_proj`,
as Meta's FP8 Maverick stores them); the VLM (`llama4`) holds that model under `language_model.`
beside its vision tower and projector, which travel unchanged."""

from __future__ import annotations

import dataclasses

from eprt.config import ModelConfig
from eprt.families.kimi_k25 import layout as kimi_k25
from eprt.layout import ExpertStorage, Layout, gated_mlp, gqa_attention, plain, stacked_experts

VISION = (r"vision_model\..+", r"multi_modal_projector\..+")
EXPERTS = ExpertStorage(fused=("gate_up_proj", "down_proj"), transposed=True)


def text_layout(c: ModelConfig) -> Layout:
    D = c.hidden_size
    specs = [plain("model.embed_tokens.weight", c.vocab_size, D)]
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        specs += [plain(f"{p}.input_layernorm.weight", D), plain(f"{p}.post_attention_layernorm.weight", D)]
        specs += gqa_attention(f"{p}.self_attn", c)
        ff = f"{p}.feed_forward"
        if c.is_moe(i):
            m = c.moe
            specs.append(plain(f"{ff}.router.weight", m.num_experts, D))
            specs += stacked_experts(f"{ff}.experts", m.num_experts, m.intermediate_size, D, storage=EXPERTS)
            specs += gated_mlp(f"{ff}.shared_expert", D, m.intermediate_size)
        else:
            specs += gated_mlp(ff, D, c.intermediate_size)
    specs.append(plain("model.norm.weight", D))
    if not c.tie_word_embeddings:
        specs.append(plain("lm_head.weight", c.vocab_size, D))
    return Layout(tuple(specs))


def layout(c: ModelConfig) -> Layout:
    """The VLM: the text layout under `language_model.`, the vision tower and projector carried."""
    text = text_layout(c)
    return dataclasses.replace(
        kimi_k25.vlm_layout(text), passthrough=(*kimi_k25.under_language_model(text.passthrough), *VISION)
    )
