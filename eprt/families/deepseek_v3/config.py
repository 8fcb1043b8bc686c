"""DeepSeek-V3 and Kimi-K2 (same architecture): reading config.json (the tensor layout is layout.py)."""

from __future__ import annotations

from eprt.config import MLAConfig, ModelConfig, moe_or_dense, read_rope, require_silu
from eprt.config_fields import Fields


def parse(hf: dict, source: str) -> ModelConfig:
    f = Fields(hf, source)
    n_layers = f.get("num_hidden_layers")
    first_dense = f.get("first_k_dense_replace", default=3)
    # transformers ignores moe_layer_freq while DeepSeek's own code honours it; they agree only at 1.
    if f.get("moe_layer_freq", default=1) != 1:
        raise f.refuse("moe_layer_freq != 1 is not supported (the reference implementations disagree on it)")
    if f.get("scoring_func", default="sigmoid") != "sigmoid" or f.get("topk_method", default="noaux_tc") != "noaux_tc":
        raise f.refuse(
            "only the sigmoid noaux_tc router of DeepSeek-V3 is supported "
            f"(scoring_func={hf.get('scoring_func')!r}, topk_method={hf.get('topk_method')!r})"
        )
    refuse_other_mla(f, "DeepSeek-V3")
    require_silu(f, "DeepSeek-V3")
    n_heads = read_mla_heads(f)
    n_experts = f.get("n_routed_experts", "num_local_experts", default=256)
    return ModelConfig(
        family="deepseek_v3",
        model_type=hf["model_type"],
        vocab_size=f.get("vocab_size"),
        hidden_size=f.get("hidden_size"),
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=f.get("intermediate_size", default=18432),
        max_position_embeddings=f.get("max_position_embeddings", default=4096),
        rope=read_rope(f),
        mla=read_mla(f),
        moe=moe_or_dense(
            (i for i in range(n_layers) if i >= first_dense and n_experts > 0),
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(n_experts, "num_experts_per_tok", default=8),
            intermediate_size=f.get("moe_intermediate_size", default=2048),
            num_shared_experts=f.get("n_shared_experts", default=1),
            router="sigmoid",
            norm_topk_prob=bool(f.get("norm_topk_prob", default=True)),
            routed_scaling_factor=float(f.get("routed_scaling_factor", default=2.5)),
            n_group=f.get("n_group", default=8),
            topk_group=f.get("topk_group", default=4),
        ),
        num_nextn_predict_layers=f.get("num_nextn_predict_layers", "num_mtp_layers", default=0),
    )


def read_mla(f: Fields) -> MLAConfig:
    """MLA's sizes, where absent DeepSeek-V3's (Kimi's reference assumes the same)."""
    return MLAConfig(
        q_lora_rank=f.get("q_lora_rank", default=None) or None,  # 0 in a file: no low-rank q
        kv_lora_rank=f.get("kv_lora_rank", default=512),
        qk_nope_head_dim=f.get("qk_nope_head_dim", default=128),
        qk_rope_head_dim=f.get("qk_rope_head_dim", default=64),
        v_head_dim=f.get("v_head_dim", default=128),
    )


def read_mla_heads(f: Fields) -> int:
    """The attention heads of an MLA model, each its own key/value head."""
    n_heads = f.get("num_attention_heads")
    if f.get("num_key_value_heads", default=n_heads) != n_heads:
        raise f.refuse(
            "num_key_value_heads differs from num_attention_heads; MLA expands its latent into "
            "one key/value head per attention head"
        )
    return n_heads


def refuse_other_mla(f: Fields, model: str) -> None:
    """DeepSeek-V3's MLA as `model` has it and eprt runs it: no biases, RoPE on interleaved pairs."""
    if f.get("attention_bias", default=False):
        raise f.refuse(f"attention_bias is true; {model}'s attention has no biases and eprt refuses to guess them")
    if not f.get("rope_interleave", default=True):
        raise f.refuse(f"rope_interleave is false; {model} rotates interleaved pairs and eprt runs only that")
