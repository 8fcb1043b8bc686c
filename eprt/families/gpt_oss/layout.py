"""GPT-OSS's tensors: `model.layers.N.self_attn.{q,k,v,o}_proj` with biases and `self_attn.sinks` [H];
`mlp.router` (weight and bias); the routed experts fused, transposed and interleaved, as transformers
holds them (`mlp.experts.gate_up_proj` [E, D, 2I], gate and up alternating along its last dim,
`gate_up_proj_bias` [E, 2I] alike, `down_proj` [E, I, D], `down_proj_bias` [E, D]). The release
stores the expert weights MXFP4-encoded in the same places (`gate_up_proj_blocks`/`_scales`,
eprt.storage.mxfp4_blocks), their biases as they are."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.layout import ExpertPieces, ExpertStorage, Layout, gqa_attention, plain, stacked_experts

EXPERTS = ExpertStorage(fused=("gate_up_proj", "down_proj"), transposed=True, interleaved=True)


def pieces(c: ModelConfig) -> ExpertPieces:
    return ExpertPieces(bias=True, activation=c.own.activation)


def layout(c: ModelConfig) -> Layout:
    D, m = c.hidden_size, c.moe
    specs = [plain("model.embed_tokens.weight", c.vocab_size, D)]
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        specs += [plain(f"{p}.input_layernorm.weight", D), plain(f"{p}.post_attention_layernorm.weight", D)]
        specs += gqa_attention(f"{p}.self_attn", c)
        specs.append(plain(f"{p}.self_attn.sinks", c.num_heads))
        specs += [plain(f"{p}.mlp.router.weight", m.num_experts, D), plain(f"{p}.mlp.router.bias", m.num_experts)]
        specs += stacked_experts(
            f"{p}.mlp.experts", m.num_experts, m.intermediate_size, D, pieces=pieces(c), storage=EXPERTS
        )
    specs.append(plain("model.norm.weight", D))
    if not c.tie_word_embeddings:
        specs.append(plain("lm_head.weight", c.vocab_size, D))
    return Layout(tuple(specs))
