"""One normalized ModelConfig for every family, and the tools a family's reader reads config.json with.

Each family's reader lives in `eprt/families/<name>.py` and the family table
(`eprt/families/__init__.py`) says which `model_type`s it reads. Fields are read from the file;
where a field is absent, the value is the one the family's reference implementation
(transformers) assumes, never a guess of ours.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from eprt.errors import ConfigError


@dataclass(frozen=True)
class GQAConfig:
    """Grouped-query attention beyond Qwen3's (GLM-4.5, Qwen3-Next): RoPE on the leading
    `rotary_dim` dims of each head only, per-head q/k RMSNorm optional, the output projection
    without the bias that q/k/v carry under attention_bias, and with `output_gate` (Qwen3-Next)
    q_proj giving each head a gate beside its query, sigmoid(gate) scaling the head's output."""
    rotary_dim: int
    qk_norm: bool
    output_bias: bool
    output_gate: bool = False


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2): `n_heads` heads of
    `head_dim` score every earlier key, and each query attends to its `topk` best keys only."""
    n_heads: int
    head_dim: int
    topk: int


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Gated DeltaNet linear attention (Qwen3-Next, Qwen3.5): which layers run it and their sizes.
    Each key head serves value_heads / key_heads value heads."""
    layers: tuple[int, ...]
    key_heads: int
    value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    # Qwen3-Next fuses the input projections per key head (in_proj_qkvz, in_proj_ba); Qwen3.5
    # stores them apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a).
    split_projections: bool


@dataclass(frozen=True)
class QwenNextConfig:
    """What Qwen3-Next and Qwen3.5-MoE add to a Qwen3 decoder: Gated DeltaNet layers between the
    gated full-attention ones (their partial rotary and output gate are `ModelConfig.gqa`'s), and
    a shared expert behind a sigmoid gate."""
    gated_delta_net: GatedDeltaNetConfig
    shared_expert_intermediate_size: int

    @classmethod
    def from_json(cls, d: dict) -> "QwenNextConfig":
        gdn = d["gated_delta_net"]
        return cls(**{**d, "gated_delta_net": GatedDeltaNetConfig(**{**gdn, "layers": tuple(gdn["layers"])})})


@dataclass(frozen=True)
class ModelConfig:
    family: str  # the eprt family that runs it ("qwen3_moe", "deepseek_v3")
    model_type: str  # the source's own model_type ("kimi_k2" runs as deepseek_v3)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    intermediate_size: int  # width of the dense MLP layers
    # attention: "gqa" (Qwen3: per-head q/k norm) or "mla" (DeepSeek-V3)
    attention: str
    num_kv_heads: int
    head_dim: int  # gqa head dim; for mla the rope part (as transformers sets it)
    attention_bias: bool
    rope_theta: float
    # None, or {"type": "yarn", "factor", "original_max_position_embeddings", "beta_fast", ...}
    rope_scaling: dict | None
    max_position_embeddings: int
    q_lora_rank: int | None = None
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    # mixture of experts
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    router: str = "softmax"  # "softmax" (Qwen3) or "sigmoid" (noaux_tc, DeepSeek-V3)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    hidden_act: str = "silu"
    num_nextn_predict_layers: int = 0  # DeepSeek-V3 MTP layers: carried, not run
    qwen_next: QwenNextConfig | None = None  # Qwen3-Next and Qwen3.5-MoE only
    extra: dict = field(default_factory=dict)
    gqa: GQAConfig | None = None  # None: Qwen3's (full rotary, q/k norm, every projection biased alike)
    indexer: IndexerConfig | None = None

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def rotary_dim(self) -> int:
        """How many dims of each head RoPE rotates (head_dim is the rope part already for MLA)."""
        return self.gqa.rotary_dim if self.gqa else self.head_dim

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["moe_layers"] = tuple(d["moe_layers"])
        for name, sub in (("gqa", GQAConfig), ("indexer", IndexerConfig)):
            if d.get(name) is not None:
                d[name] = sub(**d[name])
        if d.get("qwen_next"):
            d["qwen_next"] = QwenNextConfig.from_json(d["qwen_next"])
        return cls(**d)


# Fields whose value is a count or a size, and fields that are any real number: a string or a
# bool there (`"hidden_size": "4096"`) is refused by name instead of failing deep in the model.
INTEGER_FIELDS = frozenset({
    "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts", "n_routed_experts",
    "num_experts_per_tok", "num_experts_per_token", "n_shared_experts", "num_shared_experts", "first_k_dense_replace",
    "decoder_sparse_step", "moe_layer_freq", "max_position_embeddings", "model_max_length", "q_lora_rank",
    "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "n_group", "num_expert_group",
    "topk_group", "num_nextn_predict_layers", "num_mtp_layers", "num_heads", "linear_num_heads", "linear_head_dim",
    "short_conv_kernel_size", "linear_conv_kernel_dim", "routed_expert_hidden_size", "attn_res_block_size",
    "original_max_position_embeddings", "index_topk", "index_n_heads", "index_head_dim", "linear_num_key_heads",
    "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim", "shared_expert_intermediate_size",
    "full_attention_interval",
})
REAL_FIELDS = frozenset({"rms_norm_eps", "rope_theta", "routed_scaling_factor", "activation_situ_beta",
                         "activation_situ_linear_beta", "gate_lower_bound",
                         "partial_rotary_factor",
                         # the RoPE scaling parameters (rope_scaling / rope_parameters)
                         "factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim"})


class Fields:
    """Reads fields of one config dict, naming the file in every error."""

    def __init__(self, d: dict, source: str):
        self.d, self.source = d, source

    def has(self, *names: str) -> bool:
        return any(n in self.d and self.d[n] is not None for n in names)

    def get(self, *names: str, default: Any = ConfigError) -> Any:
        """The first of `names` present (transformers 4 and 5 spell some fields differently)."""
        for n in names:
            if n in self.d and self.d[n] is not None:
                return self.checked(n, self.d[n])
        if default is ConfigError:
            raise ConfigError(f"{self.source}: required field {' / '.join(names)} is missing")
        return default

    def checked(self, name: str, value: Any) -> Any:
        """`value` if it has the type field `name` needs (bool is no number here, whatever Python says)."""
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if name in INTEGER_FIELDS and not (number and float(value).is_integer()):
            raise self.refuse(f"field {name!r} is {value!r} ({type(value).__name__}); it must be an integer: "
                              "write it as a JSON number")
        if name in REAL_FIELDS and not number:
            raise self.refuse(f"field {name!r} is {value!r} ({type(value).__name__}); it must be a number: "
                              "write it as a JSON number")
        return int(value) if name in INTEGER_FIELDS else value

    def experts_per_token(self, num_experts: int, *names: str, default: int) -> int:
        """How many routed experts each token goes to: 1 to `num_experts` in a model with experts."""
        top_k = self.get(*names, default=default)
        if num_experts and not 1 <= top_k <= num_experts:
            spelled = next((n for n in names if n in self.d), names[0])
            raise self.refuse(f"field {spelled!r} is {top_k}; each token goes to 1 to {num_experts} routed experts "
                              "(the model's expert count): set it in that range")
        return top_k

    def refuse(self, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {msg}")


def read_rope(f: Fields, default_theta: float = 10000.0) -> tuple[float, dict | None]:
    """(rope_theta, scaling) from either spelling: v4 `rope_theta` + `rope_scaling`, v5 `rope_parameters`."""
    params = dict(rope_object(f, "rope_parameters") or {})
    scaling = rope_object(f, "rope_scaling")
    if scaling:
        params = {**params, **scaling}
    # each parameter has the type its field needs, named where it stands
    scoped = Fields(params, f"{f.source} (rope parameters)")
    params = {k: scoped.checked(k, v) if v is not None else v for k, v in params.items()}
    theta = float(params.pop("rope_theta", f.get("rope_theta", default=default_theta)))
    params.pop("partial_rotary_factor", None)  # how many dims rotate, not how: see read_rotary_dim
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind == "default":
        return theta, None
    if kind != "yarn":
        raise f.refuse(f"rope scaling type {kind!r} is not supported (eprt runs default RoPE and yarn)")
    if "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = f.get("original_max_position_embeddings")
    return theta, {"type": "yarn", **params}


def rope_object(f: Fields, name: str) -> dict | None:
    """`rope_scaling` / `rope_parameters`: absent, null or a JSON object."""
    value = f.get(name, default=None)
    if value is not None and not isinstance(value, dict):
        raise f.refuse(f"field {name!r} is {value!r} ({type(value).__name__}); it must be a JSON object of RoPE "
                       "parameters, or null")
    return value


def read_rotary_dim(f: Fields, head_dim: int, default_factor: float) -> int:
    """How many leading dims of each head RoPE rotates: int(head_dim * partial_rotary_factor), the
    factor from v5 `rope_parameters` or the v4 top level; an even count from 2 to head_dim."""
    params = f.get("rope_parameters", default={}) or {}
    factor = params.get("partial_rotary_factor")
    factor = f.checked("partial_rotary_factor", factor) if factor is not None else \
        f.get("partial_rotary_factor", default=default_factor)
    dim = int(head_dim * factor)
    if not (2 <= dim <= head_dim and dim % 2 == 0):
        raise f.refuse(f"partial_rotary_factor {factor} of head_dim {head_dim} rotates {dim} dims; RoPE needs an "
                       f"even count from 2 to {head_dim}: fix partial_rotary_factor")
    return dim
