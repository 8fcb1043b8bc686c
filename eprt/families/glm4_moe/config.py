"""GLM-4.5 / GLM-4.6 (`glm4_moe`): DeepSeek-V3's MoE decoder (sigmoid noaux_tc router with its
correction bias, shared experts, the first layers dense, MTP layers carried through) around
grouped-query attention with partial rotary, optional q/k norm and q/k/v biases."""

from __future__ import annotations

from eprt.config import (
    GQAConfig,
    ModelConfig,
    moe_or_dense,
    read_expert_groups,
    read_kv_heads,
    read_rope,
    read_rotary_dim,
    require_silu,
)
from eprt.config_fields import Fields


def parse(hf: dict, source: str) -> ModelConfig:
    f = Fields(hf, source)
    n_layers = f.get("num_hidden_layers")
    first_dense = f.get("first_k_dense_replace", default=1)
    require_silu(f, "GLM-4.5")
    n_heads, hidden = f.get("num_attention_heads"), f.get("hidden_size")
    n_kv = read_kv_heads(f, n_heads, default=8)
    head_dim = f.get("head_dim", default=hidden // n_heads)
    n_experts = f.get("n_routed_experts", "num_local_experts", default=128)
    n_group, topk_group = read_expert_groups(f, n_experts)
    return ModelConfig(
        family="glm4_moe",
        model_type=hf["model_type"],
        vocab_size=f.get("vocab_size"),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=f.get("intermediate_size", default=10944),
        max_position_embeddings=f.get("max_position_embeddings", default=131072),
        rope=read_rope(f),
        # transformers 5 still assumes half the head rotates where the file says nothing
        gqa=GQAConfig(
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rotary_dim=read_rotary_dim(f, head_dim, default_factor=0.5),
            qk_norm=bool(f.get("use_qk_norm", default=False)),
            qkv_bias=bool(f.get("attention_bias", default=False)),
            output_bias=False,
        ),
        moe=moe_or_dense(
            (i for i in range(n_layers) if i >= first_dense and n_experts > 0),
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(n_experts, "num_experts_per_tok", default=8),
            intermediate_size=f.get("moe_intermediate_size", default=1408),
            num_shared_experts=f.get("n_shared_experts", default=1),
            router="sigmoid",
            norm_topk_prob=bool(f.get("norm_topk_prob", default=True)),
            routed_scaling_factor=float(f.get("routed_scaling_factor", default=1.0)),
            n_group=n_group,
            topk_group=topk_group,
        ),
        # transformers assumes one MTP layer where the file names none; absent tensors carry nothing
        num_nextn_predict_layers=f.get("num_nextn_predict_layers", "num_mtp_layers", default=1),
    )
