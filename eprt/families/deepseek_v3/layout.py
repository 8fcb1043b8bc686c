"""DeepSeek-V3 and Kimi-K2: the Hugging Face tensor layout, the checkpoint's tensors as eprt reads and writes them."""

from __future__ import annotations

from dataclasses import replace

from eprt.config import ModelConfig
from eprt.layout import Layout, decoder_specs, gated_mlp, mla_attention, plain, stacked_experts


def mlp(p: str, c: ModelConfig, i: int) -> list:
    """Layer i's MLP: DeepSeek-V3's MoE (a sigmoid router with its correction bias, the stacked
    routed experts, the shared experts) or, in the first dense layers, a gated MLP."""
    D, m = c.hidden_size, c.moe
    if not c.is_moe(i):
        return gated_mlp(f"{p}.mlp", D, c.intermediate_size)
    specs = [
        plain(f"{p}.mlp.gate.weight", m.num_experts, D),
        plain(f"{p}.mlp.gate.e_score_correction_bias", m.num_experts),
    ]
    specs += stacked_experts(
        f"{p}.mlp.experts", m.num_experts, m.intermediate_size, D, "gate_proj", "up_proj", "down_proj"
    )
    if m.num_shared_experts:
        specs += gated_mlp(f"{p}.mlp.shared_experts", D, m.intermediate_size * m.num_shared_experts)
    return specs


def mtp_passthrough(c: ModelConfig) -> tuple[str, ...]:
    """The multi-token-prediction layers follow the decoder layers; the causal LM does not run them,
    but export must write them back, so convert carries them through as they are."""
    return tuple(rf"model\.layers\.{c.num_layers + k}\..+" for k in range(c.num_nextn_predict_layers))


def mtp_layout(c: ModelConfig, k: int, attention=mla_attention) -> Layout:
    """MTP layer k's tensors as the releases store them (`model.layers.{num_hidden_layers + k}`):
    a decoder layer (MoE when the model has MoE layers, as DeepSeek-V3's last layer is) plus its
    own embedding table, enorm, hnorm, eh_proj and shared head."""
    D, index = c.hidden_size, c.num_layers + k
    p = f"model.layers.{index}"
    moe = replace(c, moe=replace(c.moe, layers=c.moe.layers + (index,))) if c.moe else c
    specs = [plain(f"{p}.input_layernorm.weight", D), plain(f"{p}.post_attention_layernorm.weight", D)]
    specs += attention(f"{p}.self_attn", c) + mlp(p, moe, index)
    specs += [
        plain(f"{p}.enorm.weight", D),
        plain(f"{p}.hnorm.weight", D),
        plain(f"{p}.eh_proj.weight", D, 2 * D),
        plain(f"{p}.embed_tokens.weight", c.vocab_size, D),
        plain(f"{p}.shared_head.norm.weight", D),
        plain(f"{p}.shared_head.head.weight", c.vocab_size, D),
    ]
    return Layout(tuple(specs))


def decoder_layout(c: ModelConfig, attention) -> Layout:
    """DeepSeek-V3's decoder with `attention(prefix, c)`'s tensors in each layer (GLM-4.5 has GQA there)."""
    specs = decoder_specs(c, lambda p, i: attention(f"{p}.self_attn", c) + mlp(p, c, i))
    return Layout(tuple(specs), passthrough=mtp_passthrough(c))


def with_mtp(c: ModelConfig, attention) -> Layout:
    """The decoder with `attention(prefix, c)` in each layer, and its MTP layers as a recipe may
    quantize them (`Layout.mtp`): those eprt runs (eprt.families.deepseek_v3.model.DeepseekV3MTP, MLA or
    GQA attention; DeepSeek-V3.2's, with its indexer, stay carried only)."""
    mtp = tuple(s for k in range(c.num_nextn_predict_layers) for s in mtp_layout(c, k, attention).specs)
    return replace(decoder_layout(c, attention), mtp=mtp)


def layout(c: ModelConfig) -> Layout:
    return with_mtp(c, mla_attention)
