"""Qwen3-MoE: the Hugging Face tensor layout, the checkpoint's tensors as eprt reads and writes them."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.layout import Layout, gated_mlp, gqa_attention, plain, stacked_experts


def layout(c: ModelConfig) -> Layout:
    D = c.hidden_size
    specs = [plain("model.embed_tokens.weight", c.vocab_size, D)]
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        specs += [plain(f"{p}.input_layernorm.weight", D), plain(f"{p}.post_attention_layernorm.weight", D)]
        specs += gqa_attention(f"{p}.self_attn", c)
        if c.is_moe(i):
            specs.append(plain(f"{p}.mlp.gate.weight", c.moe.num_experts, D))
            specs += stacked_experts(
                f"{p}.mlp.experts", c.moe.num_experts, c.moe.intermediate_size, D, "gate_proj", "up_proj", "down_proj"
            )
        else:
            specs += gated_mlp(f"{p}.mlp", D, c.intermediate_size)
    specs.append(plain("model.norm.weight", D))
    if not c.tie_word_embeddings:
        specs.append(plain("lm_head.weight", c.vocab_size, D))
    return Layout(tuple(specs))
