"""Qwen3-MoE: reading config.json (the tensor layout is layout.py)."""

from __future__ import annotations

from eprt.config import GQAConfig, ModelConfig, moe_or_dense, read_rope, require_silu
from eprt.config_fields import Fields


def parse(hf: dict, source: str) -> ModelConfig:
    f = Fields(hf, source)
    n_layers = f.get("num_hidden_layers")
    n_experts = f.get("num_experts", "num_local_experts", default=128)
    if f.get("use_sliding_window", default=False):
        raise f.refuse("use_sliding_window is true; eprt runs full causal attention only")
    require_silu(f, "Qwen3-MoE")
    n_heads = f.get("num_attention_heads")
    hidden = f.get("hidden_size")
    head_dim = f.get("head_dim", default=hidden // n_heads)
    attention_bias = bool(f.get("attention_bias", default=False))
    return ModelConfig(
        family="qwen3_moe",
        model_type=hf["model_type"],
        vocab_size=f.get("vocab_size"),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=f.get("intermediate_size", default=6144),
        max_position_embeddings=f.get("max_position_embeddings", default=32768),
        rope=read_rope(f),
        # Qwen3's attention: full rotary, per-head q/k norm, every projection biased alike
        gqa=GQAConfig(
            num_kv_heads=f.get("num_key_value_heads", default=n_heads),
            head_dim=head_dim,
            rotary_dim=head_dim,
            qk_norm=True,
            qkv_bias=attention_bias,
            output_bias=attention_bias,
        ),
        moe=moe_or_dense(
            sparse_step_layers(f, n_layers, n_experts),
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(n_experts, "num_experts_per_tok", default=8),
            intermediate_size=f.get("moe_intermediate_size", default=768),
            num_shared_experts=0,
            router="softmax",
            # transformers' default is False, although Qwen3-30B-A3B sets it true: read the file.
            norm_topk_prob=bool(f.get("norm_topk_prob", default=False)),
        ),
    )


def sparse_step_layers(f: Fields, n_layers: int, n_experts: int) -> tuple[int, ...]:
    """Qwen's MoE layers: every `decoder_sparse_step`-th, less the `mlp_only_layers`; none without experts."""
    step = f.get("decoder_sparse_step", default=1)
    mlp_only = set(f.get("mlp_only_layers", default=[]) or [])
    return tuple(i for i in range(n_layers) if i not in mlp_only and n_experts > 0 and (i + 1) % step == 0)
