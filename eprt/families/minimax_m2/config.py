"""MiniMax-M2 / M2.5 / M2.7 (`minimax_m2`): config.json -> ModelConfig.

Every layer is grouped-query attention (a q/k RMSNorm over the whole projection, partial RoPE) and
routed experts (sigmoid scores, the correction bias chooses, plain top-k, weights renormalized; no
shared expert). The release describes some of this with switches that transformers and vLLM read
as fixed (`use_qk_norm`, `qk_norm_type`, `scoring_func`, `use_routing_bias`, `attn_type_list`,
`shared_intermediate_size`): any other value is a model eprt does not run, and is refused."""

from __future__ import annotations

from dataclasses import dataclass

from eprt.config import (
    FamilyConfig,
    GQAConfig,
    ModelConfig,
    MoEConfig,
    own_config,
    read_kv_heads,
    read_rope,
    read_rotary_dim,
    require_silu,
)
from eprt.config_fields import MAX_LAYERS, Fields

NAME = "minimax_m2"
# The release's switches for what transformers' and vLLM's MiniMax-M2 always do: (field, the value
# they assume, what another value would mean).
FIXED = (
    ("use_qk_norm", True, "attention without its q/k norm"),
    ("qk_norm_type", "per_layer", "a q/k norm other than one over the whole projection"),
    ("scoring_func", "sigmoid", "a router other than sigmoid scores"),
    ("use_routing_bias", True, "a router without its correction bias"),
    ("shared_intermediate_size", 0, "a shared expert"),
)


@own_config(NAME)
@dataclass(frozen=True)
class MiniMaxM2Own(FamilyConfig):
    """`mtp_modules` multi-token-prediction modules stored after the decoder, as
    `model.layers.{num_layers + i}.*`: carried through as stored (the engines skip them too)."""

    mtp_modules: int


def parse(hf: dict, source: str) -> ModelConfig:
    f = Fields(hf, source)
    for name, assumed, meaning in FIXED:
        if f.get(name, default=assumed) != assumed:
            raise f.refuse(f"{name} is {hf[name]!r}: {meaning}, which MiniMax-M2 does not have (it is {assumed!r})")
    kinds = f.get("attn_type_list", default=[])
    if not isinstance(kinds, list):
        raise f.refuse(
            f"field 'attn_type_list' is {kinds!r:.80}; it must be a JSON list of layer kinds (1: full attention)"
        )
    if any(kind != 1 for kind in kinds):
        raise f.refuse(
            "attn_type_list marks linear-attention layers (0): that is MiniMax-01's hybrid, which eprt does "
            "not run; MiniMax-M2 has full attention (1) in every layer"
        )
    require_silu(f, "MiniMax-M2")
    n_layers, hidden = f.get("num_hidden_layers"), f.get("hidden_size")
    n_heads = f.get("num_attention_heads")
    n_kv = read_kv_heads(f, n_heads, default=8)
    head_dim = f.get("head_dim", default=hidden // n_heads)
    n_experts = f.get("num_local_experts", "num_experts", default=256)
    if n_experts < 1:
        raise f.refuse("num_local_experts is 0: every MiniMax-M2 layer routes to experts")
    mtp = f.integer("num_mtp_modules", 0, 0, MAX_LAYERS) if f.get("use_mtp", default=False) is True else 0
    return ModelConfig(
        family=NAME,
        model_type=hf["model_type"],
        vocab_size=f.get("vocab_size"),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=0,  # no dense MLP: `intermediate_size` is each expert's width
        max_position_embeddings=f.get("max_position_embeddings", default=196608),
        rope=read_rope(f, default_theta=5000000.0),
        gqa=GQAConfig(
            num_kv_heads=n_kv,
            head_dim=head_dim,
            rotary_dim=rotary_dim(f, head_dim),
            qk_norm=True,
            qkv_bias=bool(f.get("attention_bias", default=False)),
            output_bias=False,
        ),
        moe=MoEConfig(
            layers=tuple(range(n_layers)),
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(n_experts, "num_experts_per_tok", default=8),
            intermediate_size=f.get("intermediate_size", default=1536),
            num_shared_experts=0,
            router="sigmoid",
            norm_topk_prob=True,
        ),
        own=MiniMaxM2Own(mtp_modules=mtp),
    )


def rotary_dim(f: Fields, head_dim: int) -> int:
    """How many leading dims of each head rotate (MiniMax-M2's and M3's): `partial_rotary_factor` where
    the file gives one (transformers 5 writes it, and its default rotary_dim beside it unread), else the
    release's `rotary_dim` (the vendor's engines read both), else the whole head."""
    if f.has("partial_rotary_factor") or (f.get("rope_parameters", default={}) or {}).get("partial_rotary_factor"):
        return read_rotary_dim(f, head_dim, default_factor=1.0)
    dim = f.integer("rotary_dim", head_dim, 0, MAX_LAYERS)
    if not (2 <= dim <= head_dim and dim % 2 == 0):
        raise f.refuse(
            f"rotary_dim {dim} of head_dim {head_dim}: RoPE rotates an even count of dims from 2 to the head"
        )
    return dim
