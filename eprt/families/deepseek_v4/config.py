"""DeepSeek-V4 (`deepseek_v4`: Flash 284B, Pro 1.6T): reading config.json in both spellings, the
release's (`compress_ratios` per layer, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`) and
transformers 5.25's `save_pretrained` (`layer_types`, `mlp_layer_types`, `compress_rates`,
`rope_parameters` keyed `main` / `compress`). Which one a file uses also says how its tensors are
named (layout.py): the release's flat names, or transformers' under `model.`.

The model (docs/models.md): `hc_mult` residual streams mixed by hyper-connections; per layer one
attention kind (a sliding window; compressed sparse attention, CSA: a compressor of every
`csa_rate` tokens and an indexer choosing `index_topk` of the compressed entries; heavily
compressed attention, HCA: a compressor of every `hca_rate` tokens), each MQA with one key=value
head of `head_dim`, attention sinks and a grouped low-rank output projection; then a MoE whose
first `hash_layers` route by token id (`tid2eid`), the rest by sqrt(softplus) scores with a bias.
"""

from __future__ import annotations

from dataclasses import dataclass

from eprt.config import FamilyConfig, GQAConfig, ModelConfig, RopeConfig, moe_or_dense, own_config, read_rope
from eprt.config_fields import MAX_LAYERS, MAX_WIDTH, Fields

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
# the release's per-layer compress ratios, by the attention kind each means (transformers' reading)
KIND_OF_RATIO = {0: SLIDING, 4: CSA, 128: HCA}
MLP_KINDS = ("hash_moe", "moe")
# transformers' DeepseekV4Config defaults, for a file that leaves a field out
DEFAULT_RATES = {CSA: 4, HCA: 128}
SCORING = ("sqrtsoftplus",)


@own_config("deepseek_v4")
@dataclass(frozen=True)
class DeepseekV4Config(FamilyConfig):
    head_dim: int  # the one key=value head's width, and each query head's
    q_lora_rank: int
    o_groups: int  # the grouped output projection: heads in `o_groups` groups, each to `o_lora_rank`
    o_lora_rank: int
    sliding_window: int
    # SLIDING, CSA or HCA per decoder layer, then per multi-token-prediction layer the file lists
    # (layer num_hidden_layers + k, as DeepSeek's reference indexes compress_ratios): `kind`
    layer_kinds: tuple[str, ...]
    csa_rate: int  # tokens per compressed entry in a CSA layer
    hca_rate: int  # in an HCA layer
    compress_rope: RopeConfig  # the compressed layers' RoPE (and their compressors' and indexer's)
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hash_layers: tuple[int, ...]  # layers routing by token id
    hc_mult: int  # residual streams
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float  # every expert's gate clamped above, up clamped both ways
    transformers_names: bool  # the checkpoint is transformers' save_pretrained (names under `model.`)

    def kind(self, layer: int) -> str:
        """`layer`'s attention kind; an MTP layer the file lists no kind for (a list that stops at
        the decoder layers: transformers' spelling, which saves no MTP layer, and eprt's tiny
        configs) is of the last listed layer's kind."""
        return self.layer_kinds[min(layer, len(self.layer_kinds) - 1)]

    def rate(self, layer: int) -> int:
        """Tokens per compressed entry of `layer`'s attention, 0 for a sliding-window layer."""
        return {SLIDING: 0, CSA: self.csa_rate, HCA: self.hca_rate}[self.kind(layer)]

    def kv_cache_calibrated(self) -> bool:
        # vLLM caches V4's keys only in its own FP8 format, a UE8M0 scale per 64 dims computed as
        # each entry is written, and reads no k/v scale from the checkpoint (docs/models.md)
        return False

    def residual_streams(self) -> int:
        return self.hc_mult

    def carried_bytes(self, seq_len: int) -> int:
        """The sequence's token ids (int64), which the hash-routed layers read."""
        return 8 * seq_len


def parse(hf: dict, source: str) -> ModelConfig:
    f = Fields(hf, source)
    n_layers = f.get("num_hidden_layers")
    n_heads = f.get("num_attention_heads")
    head_dim = f.get("head_dim", default=512)
    if f.get("num_key_value_heads", default=1) != 1:
        raise f.refuse("num_key_value_heads is not 1; DeepSeek-V4's attention has one key=value head (MQA)")
    for flag in ("attention_bias", "mlp_bias"):
        if f.get(flag, default=False):
            raise f.refuse(f"{flag} is true; DeepSeek-V4 has no biases there and eprt refuses to guess them")
    act = f.get("hidden_act", default="silu")
    if act != "silu":
        raise f.refuse(f"hidden_act {act!r} is not supported (DeepSeek-V4's experts use SiLU)")
    scoring = f.get("scoring_func", default="sqrtsoftplus")
    if scoring not in SCORING:
        raise f.refuse(f"scoring_func {scoring!r} is not supported: DeepSeek-V4's router scores with sqrtsoftplus")
    if f.get("n_shared_experts", default=1) != 1:
        raise f.refuse("n_shared_experts is not 1; DeepSeek-V4's MoE has exactly one shared expert")
    n_experts = f.get("n_routed_experts", default=256)
    if not n_experts:
        raise f.refuse("n_routed_experts is 0; every DeepSeek-V4 layer is a MoE")
    rope_dim = rope_head_dim(f, head_dim)
    o_groups = small(f, "o_groups", 8)
    if n_heads % o_groups:
        raise f.refuse(f"num_attention_heads {n_heads} is not a multiple of o_groups {o_groups}")
    own = DeepseekV4Config(
        head_dim=head_dim,
        q_lora_rank=f.get("q_lora_rank", default=1024),
        o_groups=o_groups,
        o_lora_rank=small(f, "o_lora_rank", 1024),
        sliding_window=small(f, "sliding_window", 128),
        layer_kinds=layer_kinds(f, n_layers, f.get("num_nextn_predict_layers", default=1)),
        csa_rate=compress_rate(f, CSA, "compress_rate_csa"),
        hca_rate=compress_rate(f, HCA, "compress_rate_hca"),
        compress_rope=compress_rope(f),
        index_n_heads=f.get("index_n_heads", default=64),
        index_head_dim=f.get("index_head_dim", default=128),
        index_topk=f.get("index_topk", default=512),
        hash_layers=hash_layers(f, n_layers),
        hc_mult=small(f, "hc_mult", 4),
        hc_sinkhorn_iters=small(f, "hc_sinkhorn_iters", 20),
        hc_eps=positive(f, "hc_eps", 1e-6),
        swiglu_limit=positive(f, "swiglu_limit", 10.0),
        transformers_names=f.has("layer_types"),
    )
    return ModelConfig(
        family="deepseek_v4",
        model_type=hf["model_type"],
        vocab_size=f.get("vocab_size"),
        hidden_size=f.get("hidden_size"),
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=0,  # no dense MLP layer
        max_position_embeddings=f.get("max_position_embeddings", default=1048576),
        # the sliding-window layers' RoPE: plain, at rope_theta (the compressed layers' is the own config's)
        rope=RopeConfig(float(main_rope(f).get("rope_theta", f.get("rope_theta", default=10000.0)))),
        gqa=GQAConfig(1, head_dim, rope_dim, qk_norm=False, qkv_bias=False, output_bias=False),
        moe=moe_or_dense(
            range(n_layers),
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(n_experts, "num_experts_per_tok", default=6),
            intermediate_size=f.get("moe_intermediate_size", default=2048),
            num_shared_experts=1,
            router=scoring,
            norm_topk_prob=bool(f.get("norm_topk_prob", default=True)),
            routed_scaling_factor=float(f.get("routed_scaling_factor", default=1.5)),
        ),
        num_nextn_predict_layers=f.get("num_nextn_predict_layers", default=1),
        own=own,
    )


def small(f: Fields, name: str, default: int) -> int:
    """A count or width only DeepSeek-V4 has, at least 1."""
    value = f.get(name, default=default)
    if not isinstance(value, int) or isinstance(value, bool):
        raise f.refuse(f"field {name!r} is {value!r}; it must be an integer")
    return f.in_range(name, value, 1, MAX_WIDTH)


def positive(f: Fields, name: str, default: float) -> float:
    value = f.get(name, default=default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise f.refuse(f"field {name!r} is {value!r}; it must be a positive number")
    return float(value)


def main_rope(f: Fields) -> dict:
    """transformers' `rope_parameters.main` where the file nests them so, else nothing."""
    params = f.get("rope_parameters", default=None)
    return params["main"] if isinstance(params, dict) and isinstance(params.get("main"), dict) else {}


def rope_head_dim(f: Fields, head_dim: int) -> int:
    """The rotated (trailing) dims of each head: `qk_rope_head_dim`, else partial_rotary_factor x head_dim."""
    if f.has("qk_rope_head_dim"):
        dim = f.get("qk_rope_head_dim")
    else:
        factor = main_rope(f).get("partial_rotary_factor", f.get("partial_rotary_factor", default=64 / 512))
        dim = int(head_dim * factor)
    if not (2 <= dim <= head_dim and dim % 2 == 0):
        raise f.refuse(f"the rotary width {dim} of head_dim {head_dim} must be even, from 2 to {head_dim}")
    return dim


def compress_rope(f: Fields) -> RopeConfig:
    """The compressed layers' RoPE: at compress_rope_theta, with the file's YaRN scaling (nested
    under `rope_parameters.compress` by transformers), never scaling cos and sin (transformers
    forces attention_factor 1, as DeepSeek's reference applies no mscale)."""
    params = f.get("rope_parameters", default=None)
    nested = isinstance(params, dict) and isinstance(params.get("compress"), dict)
    scaling = dict(params["compress"]) if nested else dict(f.get("rope_scaling", default=None) or {})
    # a nested `compress` names its own base; a flat one's rope_theta is the sliding layers'
    theta = scaling.pop("rope_theta", None)
    theta = theta if nested and theta is not None else f.get("compress_rope_theta", default=160000.0)
    scaling.pop("partial_rotary_factor", None)
    if scaling.get("rope_type", scaling.get("type")) == "yarn":
        scaling["attention_factor"] = 1.0
    rope = read_rope(Fields({"rope_parameters": scaling, "rope_theta": theta}, f.source))
    if rope.theta <= 1:
        raise f.refuse(f"compress_rope_theta is {rope.theta}; RoPE's base must be above 1")
    return rope


def layer_kinds(f: Fields, n_layers: int, n_mtp: int) -> tuple[str, ...]:
    """Each layer's attention: `layer_types`, else the release's `compress_ratios` (0, 4, 128),
    else transformers' default (two HCA, then CSA and HCA in turn); then those of the `n_mtp`
    multi-token-prediction layers the list goes on into (the release's compress_ratios: one more
    entry per MTP layer, 0 in every release, a sliding window)."""
    if f.has("layer_types"):
        kinds = f.get("layer_types")
    elif f.has("compress_ratios"):
        ratios = f.get("compress_ratios")
        if not isinstance(ratios, list) or any(r not in KIND_OF_RATIO for r in ratios):
            raise f.refuse(f"compress_ratios must list one of {sorted(KIND_OF_RATIO)} per layer, not {ratios!r:.80}")
        kinds = [KIND_OF_RATIO[r] for r in ratios]
    else:
        kinds = [HCA] * min(n_layers, 2) + [CSA if i % 2 else HCA for i in range(max(n_layers - 2, 0))]
    if len(kinds) < n_layers or not set(kinds[: n_layers + n_mtp]) <= {SLIDING, CSA, HCA}:
        raise f.refuse(
            f"layer_types (or compress_ratios) must give each of the {n_layers} layers one of {SLIDING}, {CSA}, {HCA}"
        )
    if len(set(kinds[n_layers : n_layers + n_mtp])) > 1:
        raise f.refuse(
            "compress_ratios gives the MTP layers different attention kinds; eprt runs MTP layers of one kind"
        )
    return tuple(kinds[: n_layers + n_mtp])


def compress_rate(f: Fields, kind: str, legacy: str) -> int:
    rates = f.get("compress_rates", default=None) or {}
    if not isinstance(rates, dict):
        raise f.refuse(f"compress_rates is {rates!r:.80}; it must be an object of rates by attention kind")
    rate = rates.get(kind, f.get(legacy, default=DEFAULT_RATES[kind]))
    if not isinstance(rate, int) or isinstance(rate, bool) or not 1 <= rate <= MAX_LAYERS:
        raise f.refuse(f"the compress rate of {kind} is {rate!r}; it must be an integer from 1 to {MAX_LAYERS}")
    return rate


def hash_layers(f: Fields, n_layers: int) -> tuple[int, ...]:
    """The layers routing by token id: `mlp_layer_types` "hash_moe", else the first `num_hash_layers` (3)."""
    if f.has("mlp_layer_types"):
        kinds = f.get("mlp_layer_types")
        if len(kinds) < n_layers or not set(kinds[:n_layers]) <= set(MLP_KINDS):
            raise f.refuse(f"mlp_layer_types must give each of the {n_layers} layers one of {', '.join(MLP_KINDS)}")
        return tuple(i for i in range(n_layers) if kinds[i] == "hash_moe")
    count = f.get("num_hash_layers", default=3)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise f.refuse(f"num_hash_layers is {count!r}; it must be a count of layers")
    return tuple(range(min(count, n_layers)))
