"""MiniMax-M3's config.json: the language model's fields, in the release's spelling
(`sparse_attention_config`, `moe_layer_freq`, `rotary_dim`) or in transformers' (`layer_types`,
`mlp_layer_types`, the flat `index_*` fields, `rope_parameters.partial_rotary_factor`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from eprt.config import FamilyConfig, GQAConfig, ModelConfig, moe_or_dense, own_config, read_rope
from eprt.config_fields import MAX_LAYERS, MAX_POSITIONS, Fields, vlm_text_config
from eprt.families.minimax_m2.config import rotary_dim

TEXT_FAMILY = "minimax_m3_vl_text"  # the language model saved alone, as transformers writes it
VLM_FAMILY = "minimax_m3_vl"  # the vision-language checkpoint, as released
SPARSE = "minimax_m3_sparse"  # a `layer_types` entry: attention behind the block-sparse indexer
# transformers' names for the indexer fields, and the release's inside `sparse_attention_config`
INDEX_FIELDS = {
    "index_n_heads": "sparse_num_index_heads",
    "index_head_dim": "sparse_index_dim",
    "index_block_size": "sparse_block_size",
    "index_topk_blocks": "sparse_topk_blocks",
    "index_local_blocks": "sparse_local_block",
}
# where a field is absent: transformers' MiniMaxM3VLTextConfig
INDEX_DEFAULTS = {
    "index_n_heads": 4,
    "index_head_dim": 128,
    "index_block_size": 128,
    "index_topk_blocks": 16,
    "index_local_blocks": 1,
}


@dataclass(frozen=True)
class BlockSparseIndexerConfig:
    """The indexer of the sparse layers: `n_heads` heads of `head_dim` score every earlier key; the
    keys are pooled (max) in blocks of `block_size`, and each query attends to the `topk_blocks`
    best blocks of its head group, always including the `local_blocks` blocks ending at its own."""

    n_heads: int
    head_dim: int
    block_size: int
    topk_blocks: int
    local_blocks: int


@own_config(VLM_FAMILY, TEXT_FAMILY)
@dataclass(frozen=True)
class MiniMaxM3Config(FamilyConfig):
    """What only MiniMax-M3 has: the clamped SwiGLU of every MLP (`swiglu_alpha`, `swiglu_limit`),
    the width of the one shared expert of each MoE layer, the layers whose attention runs behind the
    block-sparse indexer, and the spelling of the tensors: transformers' (`transformers_names`: gate
    and up fused in one `gate_up_proj`, the MoE under `mlp.`, the indexer under `self_attn.indexer.`)
    or the release's (`gate_proj`/`up_proj`, `block_sparse_moe.`, `self_attn.index_*`)."""

    swiglu_alpha: float
    swiglu_limit: float
    shared_intermediate_size: int
    sparse_layers: tuple[int, ...]
    indexer: BlockSparseIndexerConfig
    transformers_names: bool

    def attention_bytes(self, seq_len: int, itemsize: int) -> int:
        """A sparse layer's indexer: its fp32 scores per index head and their masked, padded copy,
        the keys each group of heads keeps; then one group's mask and the additive bias SDPA makes of it."""
        if not self.sparse_layers:
            return 0
        T, n = seq_len, self.indexer.n_heads
        return 2 * n * T * T * 4 + n * T * T + T * T * (1 + itemsize)


def parse_text(hf: dict, source: str, family: str) -> ModelConfig:
    f = Fields(hf, source)
    n_layers = f.get("num_hidden_layers")
    hidden, n_heads = f.get("hidden_size"), f.get("num_attention_heads")
    head_dim = f.get("head_dim", default=128)
    refuse_other_branches(f)
    n_experts = f.get("num_local_experts", "num_experts", default=128)
    sparse_attn = Fields(f.get("sparse_attention_config", default={}) or {}, f"{source} (sparse_attention_config)")
    own = MiniMaxM3Config(
        swiglu_alpha=float(f.get("swiglu_alpha", default=1.702)),
        swiglu_limit=float(f.get("swiglu_limit", default=7.0)),
        shared_intermediate_size=shared_width(f),
        sparse_layers=sparse_layers(f, sparse_attn, n_layers),
        indexer=indexer(f, sparse_attn, n_heads),
        transformers_names=family == TEXT_FAMILY,
    )
    rotary = rotary_dim(f, head_dim)
    if own.sparse_layers and rotary > own.indexer.head_dim:
        raise f.refuse(
            f"rotary_dim {rotary} is wider than index_head_dim {own.indexer.head_dim}; the indexer rotates "
            "the leading dims of its heads as the attention does, so they must hold them"
        )
    return ModelConfig(
        family=family,
        model_type=hf["model_type"],
        vocab_size=f.get("vocab_size"),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=f.in_range("dense_intermediate_size", f.get("dense_intermediate_size", default=12288)),
        max_position_embeddings=f.get("max_position_embeddings", default=524288),
        rope=read_rope(f, default_theta=5000000.0),
        # per-head q/k norm, no biases
        gqa=GQAConfig(
            num_kv_heads=f.get("num_key_value_heads", default=4),
            head_dim=head_dim,
            rotary_dim=rotary,
            qk_norm=True,
            qkv_bias=False,
            output_bias=False,
        ),
        moe=moe_or_dense(
            moe_layers(f, n_layers),
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(n_experts, "num_experts_per_tok", default=4),
            intermediate_size=f.get("intermediate_size", default=3072),
            num_shared_experts=0,  # the one shared expert has a width of its own (own.shared_intermediate_size)
            router="sigmoid",
            norm_topk_prob=True,
            routed_scaling_factor=float(f.get("routed_scaling_factor", default=2.0)),
        ),
        own=own,
    )


# The release's switches (vLLM reads them) whose other settings neither transformers nor eprt runs:
# (field, the value MiniMax-M3 has, what it means)
BRANCHES = (
    ("scoring_func", "sigmoid", "the router scores by sigmoid"),
    ("use_routing_bias", True, "the router chooses with a correction bias"),
    ("swiglu_beta", 1.0, "the SwiGLU adds 1 to up"),
    ("attention_output_gate", False, "the attention has no output gate"),
    ("qk_norm_type", "per_head", "the q/k norm is per head"),
    ("use_gemma_norm", True, "every RMSNorm scales by (1 + weight)"),
)
SPARSE_BRANCHES = (
    ("sparse_score_type", "max", "a block scores the best of its keys"),
    ("sparse_init_block", 0, "no leading block is always kept"),
)


def refuse_other_branches(f: Fields) -> None:
    for name, value, meaning in BRANCHES:
        if f.d.get(name, value) != value:
            raise f.refuse(f"{name} is {f.d[name]!r}; eprt runs MiniMax-M3 as released, where {meaning} ({value!r})")


def shared_width(f: Fields) -> int:
    """The shared expert's width: transformers' shared_intermediate_size, else the release's
    n_shared_experts experts of intermediate_size."""
    if f.has("shared_intermediate_size"):
        return f.in_range("shared_intermediate_size", f.get("shared_intermediate_size"))
    width = f.get("intermediate_size", default=3072) * f.get("n_shared_experts", default=1)
    if width < 1:
        raise f.refuse("n_shared_experts is 0; MiniMax-M3's MoE layers have a shared expert")
    return width


def kinds(f: Fields, name: str, n_layers: int, allowed: set[str]) -> list[str]:
    value = f.get(name)
    if len(value) != n_layers or not set(value) <= allowed:
        raise f.refuse(f"{name} must list one of {sorted(allowed)} for each of the {n_layers} layers")
    return value


def flags(f: Fields, name: str, value, n_layers: int) -> list[bool]:
    """A release's per-layer 0/1 list (`moe_layer_freq`, `sparse_attention_freq`)."""
    if not isinstance(value, list) or len(value) != n_layers or not all(v in (0, 1) for v in value):
        raise f.refuse(f"{name} must list 0 or 1 for each of the {n_layers} layers")
    return [bool(v) for v in value]


def moe_layers(f: Fields, n_layers: int) -> tuple[int, ...]:
    """The layers with routed experts: `mlp_layer_types` ("sparse"), else the release's
    `moe_layer_freq` (1), else every layer (transformers' default)."""
    if f.has("mlp_layer_types"):
        return tuple(
            i for i, t in enumerate(kinds(f, "mlp_layer_types", n_layers, {"sparse", "dense"})) if t == "sparse"
        )
    if f.has("moe_layer_freq"):
        return tuple(i for i, on in enumerate(flags(f, "moe_layer_freq", f.d["moe_layer_freq"], n_layers)) if on)
    return tuple(range(n_layers))


def sparse_layers(f: Fields, sparse_attn: Fields, n_layers: int) -> tuple[int, ...]:
    """The layers behind the indexer: `layer_types` (SPARSE), else the release's
    `sparse_attention_config.sparse_attention_freq` (1), else none (transformers' default)."""
    if f.has("layer_types"):
        types = kinds(f, "layer_types", n_layers, {SPARSE, "full_attention"})
        return tuple(i for i, t in enumerate(types) if t == SPARSE)
    if not sparse_attn.d.get("use_sparse_attention", True) or not sparse_attn.has("sparse_attention_freq"):
        return ()
    for name, value, meaning in SPARSE_BRANCHES:
        if sparse_attn.d.get(name, value) != value:
            raise sparse_attn.refuse(
                f"{name} is {sparse_attn.d[name]!r}; eprt runs MiniMax-M3's indexer as released, where {meaning}"
            )
    on = flags(sparse_attn, "sparse_attention_freq", sparse_attn.d["sparse_attention_freq"], n_layers)
    layers = tuple(i for i, x in enumerate(on) if x)
    # the release's indexer scores only (no value or output projection of its own) on every sparse layer
    score_only = sparse_attn.d.get("sparse_disable_index_value")
    if score_only is not None and not all(i < len(score_only) and score_only[i] for i in layers):
        raise sparse_attn.refuse(
            "sparse_disable_index_value is not set on every sparse layer; an indexer with value and output "
            "projections of its own is not MiniMax-M3's (neither transformers nor eprt runs it)"
        )
    return layers


def indexer(f: Fields, sparse_attn: Fields, n_heads: int) -> BlockSparseIndexerConfig:
    def read(name: str, low: int, high: int) -> int:
        legacy = INDEX_FIELDS[name]
        where, key = (sparse_attn, legacy) if sparse_attn.has(legacy) else (f, name)
        value = where.d.get(key, INDEX_DEFAULTS[name])
        if isinstance(value, bool) or not isinstance(value, int):
            raise where.refuse(f"field {key!r} is {value!r}; it must be an integer")
        return where.in_range(key, value, low, high)

    ix = BlockSparseIndexerConfig(
        n_heads=read("index_n_heads", 1, n_heads),
        head_dim=read("index_head_dim", 2, 2**16),
        block_size=read("index_block_size", 1, MAX_POSITIONS),
        topk_blocks=read("index_topk_blocks", 1, MAX_POSITIONS),
        # at least the query's own block, so that no query is left with no key to attend to
        local_blocks=read("index_local_blocks", 1, MAX_LAYERS),
    )
    if n_heads % ix.n_heads:
        raise f.refuse(
            f"index_n_heads {ix.n_heads} does not divide num_attention_heads {n_heads}; each indexer head "
            "picks the blocks of an equal group of attention heads"
        )
    return ix


def parse(hf: dict, source: str) -> ModelConfig:
    """The vision-language checkpoint: its language model's config, under the VLM's model_type."""
    c = parse_text(vlm_text_config(hf, source), f"{source} (text_config)", VLM_FAMILY)
    return dataclasses.replace(c, model_type=hf["model_type"])


def parse_text_only(hf: dict, source: str) -> ModelConfig:
    return parse_text(hf, source, TEXT_FAMILY)
