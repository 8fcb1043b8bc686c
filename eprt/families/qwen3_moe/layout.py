"""Qwen3-MoE: the Hugging Face tensor layout, the checkpoint's tensors as eprt reads and writes them."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.layout import Layout, TensorSpec, decoder_specs, gated_mlp, gqa_attention, plain, stacked_experts


def layout(c: ModelConfig) -> Layout:
    D = c.hidden_size

    def layer(p: str, i: int) -> list[TensorSpec]:
        if not c.is_moe(i):
            return gqa_attention(f"{p}.self_attn", c) + gated_mlp(f"{p}.mlp", D, c.intermediate_size)
        return [
            *gqa_attention(f"{p}.self_attn", c),
            plain(f"{p}.mlp.gate.weight", c.moe.num_experts, D),
            *stacked_experts(
                f"{p}.mlp.experts", c.moe.num_experts, c.moe.intermediate_size, D, "gate_proj", "up_proj", "down_proj"
            ),
        ]

    return Layout(tuple(decoder_specs(c, layer)))
