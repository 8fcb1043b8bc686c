"""Mistral-Small-4's tensors, as released and as transformers 5.25 saves them (the same names):
DeepSeek-V3's MLA in every layer; a dense MLP in the first `first_k_dense_replace` layers, else
a router without correction bias, the routed experts held fused (`experts.gate_up_proj`
[E, 2I, D], `experts.down_proj` [E, D, I]; per expert also read) and the shared experts."""

from __future__ import annotations

import dataclasses

from eprt.config import ModelConfig
from eprt.families.kimi_k25 import layout as kimi_k25
from eprt.layout import Layout, decoder_specs, gated_mlp, mla_attention, plain, stacked_experts

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
    return Layout(tuple(decoder_specs(c, lambda p, i: mla_attention(f"{p}.self_attn", c) + mlp(p, c, i))))


def vlm_layout(c: ModelConfig) -> Layout:
    """The release's tensors, as transformers' Mistral3ForConditionalGeneration saves them too: the
    language model's under `language_model.` (`language_model.model.layers.N`,
    `language_model.lm_head`), the vision tower and the projector carried."""
    return dataclasses.replace(kimi_k25.vlm_layout(layout(c)), passthrough=VISION)
