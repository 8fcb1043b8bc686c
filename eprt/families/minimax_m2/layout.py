"""MiniMax-M2's tensors, as the release names them and as transformers 5.25 saves them (the same
names: its save_pretrained writes the experts back per expert, `w1` gate, `w3` up, `w2` down)."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.layout import Layout, gqa_attention, plain, stacked_experts


def layout(c: ModelConfig) -> Layout:
    D, E = c.hidden_size, c.moe.num_experts
    specs = [plain("model.embed_tokens.weight", c.vocab_size, D)]
    for i in range(c.num_layers):
        p, m = f"model.layers.{i}", f"model.layers.{i}.block_sparse_moe"
        specs += [plain(f"{p}.input_layernorm.weight", D), plain(f"{p}.post_attention_layernorm.weight", D)]
        specs += gqa_attention(f"{p}.self_attn", c, whole_qk_norm=True)
        # the correction bias sits on the block, beside the router, not in it
        specs += [plain(f"{m}.gate.weight", E, D), plain(f"{m}.e_score_correction_bias", E)]
        specs += stacked_experts(f"{m}.experts", E, c.moe.intermediate_size, D, "w1", "w3", "w2")
    specs.append(plain("model.norm.weight", D))
    if not c.tie_word_embeddings:
        specs.append(plain("lm_head.weight", c.vocab_size, D))
    mtp = range(c.num_layers, c.num_layers + c.own.mtp_modules)
    return Layout(tuple(specs), passthrough=tuple(rf"model\.layers\.{k}\..+" for k in mtp))
