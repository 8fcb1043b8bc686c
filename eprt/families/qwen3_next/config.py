"""Qwen3-Next: reading config.json (the tensor layout is layout.py).

Layers are Gated DeltaNet (`linear_attn`) or gated full attention (`self_attn`), as `layer_types`
lists them (or every `full_attention_interval`-th layer full, transformers' default 4). The MLP
is softmax-routed experts plus one shared expert scaled by a sigmoid gate (`shared_expert_gate`).
"""

from __future__ import annotations

from eprt.config import (
    GatedDeltaNetConfig,
    GQAConfig,
    ModelConfig,
    QwenNextConfig,
    moe_or_dense,
    read_rope,
    read_rotary_dim,
    require_silu,
)
from eprt.config_fields import Fields
from eprt.families.qwen3_moe.config import sparse_step_layers


def parse(hf: dict, source: str) -> ModelConfig:
    return parse_text(hf, source, "qwen3_next", split_projections=False)


def parse_text(
    hf: dict,
    source: str,
    family: str,
    split_projections: bool,
    every_layer_moe: bool = False,
    model_type: str | None = None,
) -> ModelConfig:
    """The normalized config of a Qwen3-Next-style text config. Qwen3.5-MoE has experts in every
    layer and always renormalizes the top k (its config has no such fields)."""
    f = Fields(hf, source)
    n_layers = f.get("num_hidden_layers")
    if f.has("layer_types"):
        types = list(f.get("layer_types"))
        if len(types) != n_layers or set(types) - {"linear_attention", "full_attention"}:
            raise f.refuse(
                f"layer_types must list 'linear_attention' or 'full_attention' for each of the {n_layers} layers"
            )
    else:
        interval = f.get("full_attention_interval", default=4)
        types = ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n_layers)]
    n_experts = f.get("num_experts", default=512)
    if every_layer_moe:
        moe_layers = tuple(range(n_layers))
    else:
        moe_layers = sparse_step_layers(f, n_layers, n_experts)
    require_silu(f, "Qwen3-Next")
    if f.get("attention_bias", default=False):
        raise f.refuse("attention_bias is true; eprt runs Qwen3-Next attention without biases (as released)")
    n_heads, hidden = f.get("num_attention_heads"), f.get("hidden_size")
    head_dim = f.get("head_dim", default=256)
    k_heads, v_heads = f.get("linear_num_key_heads", default=16), f.get("linear_num_value_heads", default=32)
    if v_heads % k_heads:
        raise f.refuse(f"linear_num_value_heads ({v_heads}) is not a multiple of linear_num_key_heads ({k_heads})")
    gdn = GatedDeltaNetConfig(
        layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        key_heads=k_heads,
        value_heads=v_heads,
        key_head_dim=f.get("linear_key_head_dim", default=128),
        value_head_dim=f.get("linear_value_head_dim", default=128),
        conv_kernel=f.get("linear_conv_kernel_dim", default=4),
        split_projections=split_projections,
    )
    return ModelConfig(
        family=family,
        model_type=model_type or hf["model_type"],
        vocab_size=f.get("vocab_size"),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=0 if every_layer_moe else f.get("intermediate_size", default=5632),
        max_position_embeddings=f.get("max_position_embeddings", default=32768),
        rope=read_rope(f),
        # transformers' default partial_rotary_factor is 0.25; q_proj holds each head's output gate
        gqa=GQAConfig(
            num_kv_heads=f.get("num_key_value_heads", default=2),
            head_dim=head_dim,
            rotary_dim=read_rotary_dim(f, head_dim, default_factor=0.25),
            qk_norm=True,
            qkv_bias=False,
            output_bias=False,
            output_gate=True,
        ),
        moe=moe_or_dense(
            moe_layers,
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(
                n_experts, "num_experts_per_tok", default=8 if every_layer_moe else 10
            ),
            intermediate_size=f.get("moe_intermediate_size", default=512),
            num_shared_experts=0,  # its shared expert is gated: qwen_next's
            router="softmax",
            norm_topk_prob=True if every_layer_moe else bool(f.get("norm_topk_prob", default=True)),
        ),
        qwen_next=QwenNextConfig(
            gated_delta_net=gdn, shared_expert_intermediate_size=f.get("shared_expert_intermediate_size", default=512)
        ),
    )
