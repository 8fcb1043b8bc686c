"""MiniMax-M3's tensors, in the two spellings: the release's (and transformers' `save_pretrained`
of the vision-language model, which writes the release's names back) and transformers' own, as it
saves the language model alone.

    release                                      transformers (the language model alone)
    model.layers.N.block_sparse_moe.gate          model.layers.N.mlp.gate
    block_sparse_moe.e_score_correction_bias      mlp.gate.e_score_correction_bias
    block_sparse_moe.experts.E.w1 / w3 / w2       mlp.experts.gate_up_proj [E, 2I, D] / down_proj
    block_sparse_moe.shared_experts.gate_proj,    mlp.shared_experts.gate_up_proj (gate rows, then up)
      up_proj
    mlp.gate_proj, mlp.up_proj (dense layers)     mlp.gate_up_proj
    self_attn.index_q_proj (index_k_proj, ...)    self_attn.indexer.q_proj (k_proj, ...)

The vision-language checkpoint holds the language model under `language_model.` (its head
`language_model.lm_head`); the vision tower, the projectors and the multi-token-prediction layers
travel through unchanged.
"""

from __future__ import annotations

import dataclasses

from eprt.config import ModelConfig
from eprt.families.kimi_k25.layout import vlm_layout
from eprt.layout import Layout, TensorSpec, decoder_specs, gated_mlp, gqa_attention, plain, stacked_experts

# carried, not run: the vision tower, the projectors, the multi-token-prediction layers
VISION = (r"vision_tower\..+", r"multi_modal_projector\..+", r"patch_merge_mlp\..+")
MTP = (r"(language_model\.)?(model\.)?mtp\..+",)


def moe_name(c: ModelConfig) -> str:
    """The attribute a routed layer's MoE block has in the decoder layer."""
    return "mlp" if c.own.transformers_names else "block_sparse_moe"


def indexer_names(c: ModelConfig) -> dict[str, str]:
    """The indexer's pieces by their name in the attention, in the checkpoint's spelling."""
    pieces = ("q_proj", "k_proj", "q_norm", "k_norm")
    return {p: f"indexer.{p}" if c.own.transformers_names else f"index_{p}" for p in pieces}


def gated(prefix: str, D: int, width: int, fused: bool) -> list[TensorSpec]:
    """A dense MLP or the shared expert: gate_proj and up_proj, or both in one gate_up_proj."""
    if not fused:
        return gated_mlp(prefix, D, width)
    return [plain(f"{prefix}.gate_up_proj.weight", 2 * width, D), plain(f"{prefix}.down_proj.weight", D, width)]


def text_layout(c: ModelConfig) -> Layout:
    own, ix, D = c.own, c.own.indexer, c.hidden_size
    fused = own.transformers_names

    def layer(p: str, i: int) -> list[TensorSpec]:
        specs = gqa_attention(f"{p}.self_attn", c)
        if i in own.sparse_layers:
            shapes = {
                "q_proj": (ix.n_heads * ix.head_dim, D),
                "k_proj": (ix.head_dim, D),
                "q_norm": (ix.head_dim,),
                "k_norm": (ix.head_dim,),
            }
            specs += [plain(f"{p}.self_attn.{n}.weight", *shapes[k]) for k, n in indexer_names(c).items()]
        if not c.is_moe(i):
            return specs + gated(f"{p}.mlp", D, c.intermediate_size, fused)
        m, E = f"{p}.{moe_name(c)}", c.num_experts
        specs += [
            plain(f"{m}.gate.weight", E, D),
            # the release keeps the router's bias beside the router, on the MoE block
            plain(f"{m}.gate.e_score_correction_bias" if fused else f"{m}.e_score_correction_bias", E),
        ]
        proj = ("gate_proj", "up_proj", "down_proj") if fused else ("w1", "w3", "w2")
        specs += stacked_experts(f"{m}.experts", E, c.moe.intermediate_size, D, *proj)
        return specs + gated(f"{m}.shared_experts", D, own.shared_intermediate_size, fused)

    return Layout(tuple(decoder_specs(c, layer)), passthrough=MTP)


def layout(c: ModelConfig) -> Layout:
    """The language model alone (transformers' names), or the vision-language checkpoint's."""
    if c.own.transformers_names:
        return text_layout(c)
    return dataclasses.replace(vlm_layout(text_layout(c)), passthrough=(*MTP, *VISION))
