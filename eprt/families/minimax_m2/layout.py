"""MiniMax-M2's tensors, as the release names them and as transformers 5.25 saves them (the same
names: its save_pretrained writes the experts back per expert, `w1` gate, `w3` up, `w2` down)."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.layout import Layout, TensorSpec, decoder_specs, gqa_attention, plain, stacked_experts


def layout(c: ModelConfig) -> Layout:
    D, E = c.hidden_size, c.moe.num_experts

    def layer(p: str, i: int) -> list[TensorSpec]:
        m = f"{p}.block_sparse_moe"
        return [
            *gqa_attention(f"{p}.self_attn", c, whole_qk_norm=True),
            # the correction bias sits on the block, beside the router, not in it
            plain(f"{m}.gate.weight", E, D),
            plain(f"{m}.e_score_correction_bias", E),
            *stacked_experts(f"{m}.experts", E, c.moe.intermediate_size, D, "w1", "w3", "w2"),
        ]

    specs = decoder_specs(c, layer)
    mtp = range(c.num_layers, c.num_layers + c.own.mtp_modules)
    return Layout(tuple(specs), passthrough=tuple(rf"model\.layers\.{k}\..+" for k in mtp))
