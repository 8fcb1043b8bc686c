"""One normalized ModelConfig for every family, and the RoPE reads families share (a family's reader
reads config.json's fields with eprt.config_fields.Fields).

Each family's reader lives in `eprt/families/<name>/config.py` and the family table
(`eprt/families/__init__.py`) says which `model_type`s it reads. Fields are read from the file;
where a field is absent, the value is the one the family's reference implementation
(transformers) assumes, never a guess of ours.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from eprt.config_fields import MAX_ROUTED_EXPERTS, Fields, typed_from_json
from eprt.errors import ConfigError


@dataclass(frozen=True)
class YarnConfig:
    """YaRN RoPE scaling, its parameters as the file gives them (None: absent; the reference's
    default applies where it is used, eprt.models.rope)."""

    original_max_position_embeddings: int
    factor: float | None = None
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embeddings: the base `theta`, and YaRN scaling or none (`yarn` None)."""

    theta: float
    yarn: YarnConfig | None = None


@dataclass(frozen=True)
class GQAConfig:
    """Grouped-query attention (Qwen3, GLM-4.5, Qwen3-Next): `num_kv_heads` key/value heads of
    `head_dim`, each shared by num_heads / num_kv_heads query heads; RoPE on the leading
    `rotary_dim` dims of each head; per-head q/k RMSNorm under `qk_norm`; biases on q/k/v under
    `qkv_bias`, on the output projection under `output_bias`; and with `output_gate` (Qwen3-Next)
    q_proj giving each head a gate beside its query, sigmoid(gate) scaling the head's output."""

    num_kv_heads: int
    head_dim: int
    rotary_dim: int
    qk_norm: bool
    qkv_bias: bool
    output_bias: bool
    output_gate: bool = False


@dataclass(frozen=True)
class MLAConfig:
    """Multi-head latent attention (DeepSeek-V3, Kimi): q through a low-rank pair of `q_lora_rank`
    (None: one q_proj), keys and values expanded from a shared latent of `kv_lora_rank`. Each
    head's query/key is `qk_nope_head_dim` plain dims then `qk_rope_head_dim` rope dims (plain too
    where the model has no RoPE), its value `v_head_dim`; one key/value head per query head."""

    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class IndexerConfig:
    """DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2): `n_heads` heads of
    `head_dim` score every earlier key, and each query attends to its `topk` best keys only."""

    n_heads: int
    head_dim: int
    topk: int


@dataclass(frozen=True)
class MoEConfig:
    """The routed experts of the MoE layers (`layers`, at least one; the other layers are dense).
    Each token goes to `num_experts_per_tok` of `num_experts` experts of width `intermediate_size`,
    chosen by a "softmax" (Qwen) or "sigmoid" (DeepSeek-V3's noaux_tc: scores plus a correction
    bias, the best `topk_group` of `n_group` groups, weights times `routed_scaling_factor`) router;
    `norm_topk_prob` renormalizes the chosen weights. `num_shared_experts` DeepSeek-style shared
    experts of `intermediate_size` each run on every token (Qwen-Next's gated shared expert is
    `QwenNextConfig`'s). A family whose routed experts compute in a width of their own (Kimi-K3's
    latent) says so in its own config (`FamilyConfig.routed_width`)."""

    layers: tuple[int, ...]
    num_experts: int
    num_experts_per_tok: int
    intermediate_size: int
    num_shared_experts: int
    router: str
    norm_topk_prob: bool
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1

    def __post_init__(self):
        if not self.layers:
            raise ConfigError("MoEConfig with no MoE layers: a dense model has moe None")


def moe_or_dense(layers, **fields) -> MoEConfig | None:
    """The MoE config of a model whose MoE layers are `layers`, or None where it has none."""
    layers = tuple(layers)
    return MoEConfig(layers, **fields) if layers else None


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


@dataclass(frozen=True)
class KDAConfig:
    """Kimi Delta Attention (Kimi-Linear, Kimi-K3): which layers run it (the others run MLA) and
    their sizes. `a_log_shape` is A_log's: Moonshot's [1, 1, heads, 1], or Kimi-K3's [heads], a
    vector the release pads. Kimi-K3 adds a lower bound on the forget gate (`gate_lower_bound`,
    None: unbounded) and a full-rank output gate (g_proj in place of g_a_proj, g_b_proj)."""

    layers: tuple[int, ...]
    heads: int
    head_dim: int
    conv_kernel: int
    a_log_shape: tuple[int, ...]
    gate_lower_bound: float | None
    full_rank_gate: bool


@dataclass(frozen=True)
class SiTUConfig:
    """Kimi-K3's SiTU activation in place of SiLU: its `beta` and the bound of its linear part
    (`linear_beta`, None: unbounded)."""

    beta: float
    linear_beta: float | None


@dataclass(frozen=True)
class KimiLinearConfig:
    """What Kimi-Linear and Kimi-K3's language model add to an MLA decoder without RoPE: KDA
    layers, and the K3 options: the MLA output gate, SiTU (`situ` None: SiLU), and attention
    residuals over blocks of `attn_res_block_size` layers (None: plain residuals)."""

    kda: KDAConfig
    mla_output_gate: bool
    situ: SiTUConfig | None
    attn_res_block_size: int | None


class FamilyConfig:
    """The knobs only one family has (a clamp limit, sinks, an index-sharing pattern): a frozen
    dataclass in the family's own folder (`eprt/families/<name>/config.py`), subclassing this and
    registered for its family names with `own_config`. ModelConfig carries it as `own`, so the
    global config holds only what every family has."""

    def routed_width(self) -> int | None:
        """The width the routed experts read and write, where it is not the hidden size."""
        return None

    def attention_bytes(self, seq_len: int, itemsize: int) -> int:
        """What one sequence's attention holds at once beyond what every attention does (the memory
        plan adds it to each sequence run side by side); `itemsize` is the activations' bytes."""
        return 0

    def residual_streams(self) -> int:
        """How many residual streams of the hidden size a layer reads and writes (DeepSeek-V4's
        hyper-connections keep several): the hidden state a sequence holds between layers is
        [T, streams, hidden] where more than one, [T, hidden] where one."""
        return 1

    def kv_cache_calibrated(self) -> bool:
        """Whether a KV-cache format is calibrated for the family (its attention hands the keys and
        values it caches to the KV-cache taps) and its scales written; where not (DeepSeek-V4, whose
        engine scales its own FP8 cache and reads no scale), a run writes no KV-cache scales and
        says so (eprt.quant.run.setup.check_kv_cache)."""
        return True

    def carried_bytes(self, seq_len: int) -> int:
        """The most bytes a sequence of `seq_len` tokens holds, at once, of what its layers leave for
        later ones (eprt.models.decoder.LayerContext.carried), for the memory plan."""
        return 0


OWN_CONFIGS: dict[str, type[FamilyConfig]] = {}


def own_config(*families: str):
    """Class decorator: `cls` is the own config of these ModelConfig.family names."""

    def register(cls: type[FamilyConfig]) -> type[FamilyConfig]:
        assert dataclasses.is_dataclass(cls) and issubclass(cls, FamilyConfig), cls
        for name in families:
            OWN_CONFIGS[name] = cls
        return cls

    return register


def own_config_class(family: str, where: str) -> type[FamilyConfig]:
    """The own config class of `family`, as its folder registered it when the family table
    (eprt.families, above this module) imported it: every reader of a manifest runs under the table."""
    if family not in OWN_CONFIGS:
        raise ConfigError(f"{where}: family {family!r} has no own config, but the config holds one")
    return OWN_CONFIGS[family]


@dataclass(frozen=True)
class ModelConfig:
    """A model as eprt runs it: what every family has, then one typed part per kind of block.
    Attention is `gqa` or `mla` (exactly one); `moe` is None for a dense model; `rope` None where
    no layer rotates (Kimi's MLA)."""

    family: str  # the eprt family that runs it ("qwen3_moe", "deepseek_v3")
    model_type: str  # the source's own model_type ("kimi_k2" runs as deepseek_v3)
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int  # attention (query) heads
    rms_norm_eps: float
    tie_word_embeddings: bool
    intermediate_size: int  # width of the dense MLP layers (0 where there are none)
    max_position_embeddings: int
    rope: RopeConfig | None
    gqa: GQAConfig | None = None
    mla: MLAConfig | None = None
    moe: MoEConfig | None = None
    num_nextn_predict_layers: int = 0  # multi-token-prediction layers (steps): carried, run where the family runs them
    indexer: IndexerConfig | None = None  # DeepSeek-V3.2 (on MLA)
    qwen_next: QwenNextConfig | None = None  # Qwen3-Next and Qwen3.5-MoE (on GQA)
    kimi_linear: KimiLinearConfig | None = None  # Kimi-Linear and Kimi-K3 (on MLA)
    own: FamilyConfig | None = None  # the knobs only this family has (FamilyConfig)

    def __post_init__(self):
        if (self.gqa is None) == (self.mla is None):
            raise ConfigError("a ModelConfig has exactly one attention: gqa or mla")
        for name in ("vocab_size", "hidden_size", "num_layers", "num_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} is {getattr(self, name)}; a model has at least one")
        routed = len(self.moe_layers) * self.num_experts
        if routed > MAX_ROUTED_EXPERTS:
            raise ConfigError(
                f"{len(self.moe_layers)} MoE layers of {self.num_experts} routed experts make {routed} "
                f"experts, over the {MAX_ROUTED_EXPERTS} eprt reads (each is three tensors to name "
                "before a weight is read): the config does not describe a real model"
            )

    # The common reads of `moe`, a dense model's answer where it has none.
    @property
    def num_experts(self) -> int:
        return self.moe.num_experts if self.moe else 0

    @property
    def num_experts_per_tok(self) -> int:
        return self.moe.num_experts_per_tok if self.moe else 0

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return self.moe.layers if self.moe else ()

    def is_moe(self, layer: int) -> bool:
        return layer in self.moe_layers

    @property
    def routed_width(self) -> int:
        """The width the routed experts read and write: the hidden size, or a family's own
        (Kimi-K3's latent, `FamilyConfig.routed_width`)."""
        return (self.own.routed_width() if self.own else None) or self.hidden_size

    @property
    def residual_streams(self) -> int:
        """FamilyConfig.residual_streams: 1 but where a family keeps several."""
        return self.own.residual_streams() if self.own else 1

    @property
    def streams_shape(self) -> tuple[int, ...]:
        """The dims of the hidden state between a token's and the hidden size: (streams,) or ()."""
        return (self.residual_streams,) if self.residual_streams > 1 else ()

    @property
    def rotary_dim(self) -> int:
        """How many dims of each head RoPE rotates."""
        return self.gqa.rotary_dim if self.gqa else self.mla.qk_rope_head_dim

    @property
    def kv_head_dims(self) -> tuple[int, int]:
        """The widths of a key head and a value head as attention caches them: GQA's head_dim both;
        MLA's keys their plain and rope dims together, its values v_head_dim."""
        if self.gqa:
            return self.gqa.head_dim, self.gqa.head_dim
        return self.mla.qk_nope_head_dim + self.mla.qk_rope_head_dim, self.mla.v_head_dim

    def to_json(self) -> dict:
        """The config as the manifest stores it: every field, an own config under `own` but for one
        of fields the global config once held (`STORED_AS_BEFORE`), stored where it was, so that
        the manifest of every family keeps the bytes it always had (a calibrated checkpoint, and
        its export's quality report, pin it by digest)."""
        d = dataclasses.asdict(self)
        own = d.pop("own")
        for part, before in STORED_AS_BEFORE.items():
            if d.get(part) is None:
                continue
            held = own if own is not None and set(own) == set(before) else {}
            d[part].update({name: held.get(name, absent) for name, absent in before.items()})
            own = None if held else own
        if own is not None:  # a family without knobs of its own writes no `own`
            d["own"] = own
        return d

    @classmethod
    def from_json(cls, d: Any, source: str = "config") -> "ModelConfig":
        """The config `to_json` wrote; a field missing, unknown or of the wrong type is refused by
        its path under `source` (`config.moe.num_experts`)."""
        d = own_stored_as_before(d, source)
        if not isinstance(d, dict) or d.get("own") is None:
            return typed_from_json(cls, {**d, "own": None} if isinstance(d, dict) else d, source)
        own = d["own"]
        config = typed_from_json(cls, {**d, "own": None}, source)
        own_cls = own_config_class(config.family, f"{source}.own")
        return dataclasses.replace(config, own=typed_from_json(own_cls, own, f"{source}.own"))


# Fields the global config held once, by part, with the value that meant "absent": now an own
# config's (Kimi-K3's latent experts: LatentExperts), still stored where they were (to_json).
STORED_AS_BEFORE = {"moe": {"latent_size": None, "latent_norm": False}}


def own_stored_as_before(d: Any, source: str) -> Any:
    """`d` with the fields of `STORED_AS_BEFORE` taken out of their part: dropped where they hold
    their "absent" value, else moved to `own`, which the family's own config then reads."""
    if not isinstance(d, dict):
        return d
    out = dict(d)
    for part, before in STORED_AS_BEFORE.items():
        held = out.get(part)
        if not isinstance(held, dict):
            continue
        values = {name: held.get(name, absent) for name, absent in before.items()}
        out[part] = {k: v for k, v in held.items() if k not in before}
        if values != before:
            if out.get("own") is not None:
                raise ConfigError(f"{source}: holds both {part}.{', '.join(before)} and own: convert the source again")
            out["own"] = values
    return out


def read_rope(f: Fields, default_theta: float = 10000.0) -> RopeConfig:
    """RoPE from either spelling: v4 `rope_theta` + `rope_scaling`, v5 `rope_parameters`."""
    params = dict(rope_object(f, "rope_parameters") or {})
    scaling = rope_object(f, "rope_scaling")
    if scaling:
        params = {**params, **scaling}
    # each parameter has the type its field needs, named where it stands
    scoped = Fields(params, f"{f.source} (rope parameters)")
    params = {k: scoped.checked(k, v) for k, v in params.items() if v is not None}
    theta = float(params.pop("rope_theta", f.get("rope_theta", default=default_theta)))
    params.pop("partial_rotary_factor", None)  # how many dims rotate, not how: see read_rotary_dim
    kind = params.pop("rope_type", None) or params.pop("type", None) or "default"
    params.pop("type", None)
    if kind == "default":
        return RopeConfig(theta)
    if kind != "yarn":
        raise f.refuse(f"rope scaling type {kind!r} is not supported (eprt runs default RoPE and yarn)")
    if "original_max_position_embeddings" not in params:
        params["original_max_position_embeddings"] = f.get("original_max_position_embeddings")
    if not isinstance(params.get("truncate", True), bool):
        raise scoped.refuse(f"field 'truncate' is {params['truncate']!r}; it must be true or false")
    # parameters YaRN does not take are ignored, as the reference ignores them
    known = {x.name for x in dataclasses.fields(YarnConfig)}
    return RopeConfig(theta, YarnConfig(**{k: v for k, v in params.items() if k in known}))


def rope_object(f: Fields, name: str) -> dict | None:
    """`rope_scaling` / `rope_parameters`: absent, null or a JSON object."""
    value = f.get(name, default=None)
    if value is not None and not isinstance(value, dict):
        raise f.refuse(
            f"field {name!r} is {value!r} ({type(value).__name__}); it must be a JSON object of RoPE "
            "parameters, or null"
        )
    return value


def require_silu(f: Fields, model: str) -> None:
    """Refuses a `hidden_act` other than SiLU, the activation of `model`'s MLPs and experts."""
    act = f.get("hidden_act", default="silu")
    if act != "silu":
        raise f.refuse(f"hidden_act {act!r} is not supported ({model} uses silu)")


def read_expert_groups(f: Fields, num_experts: int) -> tuple[int, int]:
    """The router's expert groups (`n_group`) and how many of them a token chooses from (`topk_group`),
    one of each where absent; the groups split the routed experts evenly."""
    n_group, topk_group = f.get("n_group", default=1), f.get("topk_group", default=1)
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise f.refuse(
            f"n_group {n_group} / topk_group {topk_group} do not split {num_experts} routed experts into "
            "equal groups of which topk_group are kept: fix n_group or topk_group"
        )
    return n_group, topk_group


def read_kv_heads(f: Fields, num_heads: int, default: int) -> int:
    """Grouped-query attention's key/value heads (`num_key_value_heads`), each shared by a whole
    number of the `num_heads` query heads."""
    n_kv = f.get("num_key_value_heads", default=default)
    if num_heads % n_kv:
        raise f.refuse(
            f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {n_kv}: "
            "grouped-query attention shares each key/value head among a whole number of query heads"
        )
    return n_kv


def read_rotary_dim(f: Fields, head_dim: int, default_factor: float) -> int:
    """How many leading dims of each head RoPE rotates: int(head_dim * partial_rotary_factor), the
    factor from v5 `rope_parameters` or the v4 top level; an even count from 2 to head_dim."""
    params = f.get("rope_parameters", default={}) or {}
    factor = params.get("partial_rotary_factor")
    factor = (
        f.checked("partial_rotary_factor", factor)
        if factor is not None
        else f.get("partial_rotary_factor", default=default_factor)
    )
    dim = int(head_dim * factor)
    if not (2 <= dim <= head_dim and dim % 2 == 0):
        raise f.refuse(
            f"partial_rotary_factor {factor} of head_dim {head_dim} rotates {dim} dims; RoPE needs an "
            f"even count from 2 to {head_dim}: fix partial_rotary_factor"
        )
    return dim
