"""Config values read as typed and bounded: `Fields`, the tool a family's reader reads config.json
with, and `typed_from_json`, which reads a config dataclass back from the JSON the manifest stores.

Every count or size is bounded (`LIMITS`), far beyond any released model, so that what eprt builds
from a config before it reads a weight stays small; a value of the wrong type or out of range is
refused by its field's name and its file.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from typing import Any

from eprt.errors import ConfigError


def typed_from_json(cls: type, d: Any, where: str):
    """Dataclass `cls` from its `dataclasses.asdict` JSON, every field checked against its type."""
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: is {json_type(d)}, not an object of {cls.__name__} fields")
    fields = dataclasses.fields(cls)
    unknown = sorted(set(d) - {f.name for f in fields})
    if unknown:
        raise ConfigError(
            f"{where}: unknown field {unknown[0]!r}; {cls.__name__} has {', '.join(f.name for f in fields)}"
        )
    hints = typing.get_type_hints(cls)
    values = {}
    for f in fields:
        if f.name not in d:
            raise ConfigError(f"{where}.{f.name}: missing")
        values[f.name] = typed_value(hints[f.name], d[f.name], f"{where}.{f.name}", f.name)
    try:
        return cls(**values)
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}") from None


def typed_value(tp: Any, v: Any, where: str, name: str) -> Any:
    """`v` as type `tp`; `name` is the field's, whose LIMITS entry bounds an integer."""
    args = typing.get_args(tp)
    if isinstance(tp, types.UnionType):  # `X | None`, the only union a config has
        if v is None:
            return None
        (tp,) = [a for a in args if a is not type(None)]
        return typed_value(tp, v, where, name)
    if dataclasses.is_dataclass(tp):
        return typed_from_json(tp, v, where)
    if typing.get_origin(tp) is tuple:  # tuple[int, ...]
        if not isinstance(v, (list, tuple)):
            raise ConfigError(f"{where}: is {json_type(v)}, not a list")
        if len(v) > MAX_LAYERS:  # every list of a config is one of layers or of a shape
            raise ConfigError(f"{where}: lists {len(v)} entries, over the {MAX_LAYERS} eprt reads")
        return tuple(typed_value(args[0], x, f"{where}[{i}]", name) for i, x in enumerate(v))
    if tp is float and is_number(v):
        if not math.isfinite(v):
            raise ConfigError(f"{where}: is {v!r}, not a finite number")
        return float(v)
    if tp is int and is_integer(v):
        limit = LIMITS.get(name, MAX_WIDTH)
        if not 0 <= v <= limit:
            raise ConfigError(f"{where}: is {v!r}, outside [0, {limit}]")
        return int(v)
    if tp in (bool, str) and isinstance(v, tp):
        return v
    wanted = {int: "an integer", float: "a number", bool: "a boolean", str: "a string"}[tp]
    raise ConfigError(f"{where}: is {json_type(v)} ({v!r}), not {wanted}")


def json_type(v: Any) -> str:
    return {
        bool: "a boolean",
        int: "a number",
        float: "a number",
        str: "a string",
        list: "a list",
        tuple: "a list",
        dict: "an object",
        type(None): "null",
    }.get(type(v), type(v).__name__)


# Fields whose value is a count or a size, and fields that are any real number: a string or a
# bool there (`"hidden_size": "4096"`) is refused by name instead of failing deep in the model.
INTEGER_FIELDS = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "num_experts_per_tok",
        "num_experts_per_token",
        "n_shared_experts",
        "num_shared_experts",
        "first_k_dense_replace",
        "decoder_sparse_step",
        "moe_layer_freq",
        "max_position_embeddings",
        "model_max_length",
        "q_lora_rank",
        "kv_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "v_head_dim",
        "n_group",
        "num_expert_group",
        "topk_group",
        "num_nextn_predict_layers",
        "num_mtp_layers",
        "num_heads",
        "linear_num_heads",
        "linear_head_dim",
        "short_conv_kernel_size",
        "linear_conv_kernel_dim",
        "routed_expert_hidden_size",
        "attn_res_block_size",
        "original_max_position_embeddings",
        "index_topk",
        "index_n_heads",
        "index_head_dim",
        "index_topk_freq",
        "index_skip_topk_offset",
        "linear_num_key_heads",
        "linear_num_value_heads",
        "linear_key_head_dim",
        "linear_value_head_dim",
        "shared_expert_intermediate_size",
        "full_attention_interval",
        "mamba_num_heads",
        "mamba_head_dim",
        "ssm_state_size",
        "n_groups",
        "conv_kernel",
        "chunk_size",
        "moe_shared_expert_intermediate_size",
        "moe_latent_size",
    }
)
# The counts that may be 0 (no experts, no dense MLP, no low-rank q, no MTP layers, no rope dims
# in a head); every other one is at least 1 (a divisor, a step or a width something is built of).
ZERO_ALLOWED = frozenset(
    {
        "intermediate_size",
        "moe_intermediate_size",
        "num_experts",
        "num_local_experts",
        "n_routed_experts",
        "num_experts_per_tok",
        "num_experts_per_token",
        "n_shared_experts",
        "num_shared_experts",
        "first_k_dense_replace",
        "q_lora_rank",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
        "num_nextn_predict_layers",
        "num_mtp_layers",
        "shared_expert_intermediate_size",
        "moe_shared_expert_intermediate_size",
        "index_topk_freq",  # GLM-5's index-sharing schedule: 0 reads as 1, as transformers reads it
        "index_skip_topk_offset",
    }
)
REAL_FIELDS = frozenset(
    {
        "rms_norm_eps",
        "rope_theta",
        "routed_scaling_factor",
        "activation_situ_beta",
        "activation_situ_linear_beta",
        "gate_lower_bound",
        "partial_rotary_factor",
        "llama_4_scaling_beta",
        "layer_norm_epsilon",
        # the RoPE scaling parameters (rope_scaling / rope_parameters)
        "factor",
        "attention_factor",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
    }
)
# Reals that must exceed a bound: a norm's epsilon and the scaling factors are positive, and RoPE's
# frequencies theta^(-2i/d) fall only for theta above 1 (YaRN divides by log(theta)).
REAL_ABOVE = {
    "rms_norm_eps": 0,
    "layer_norm_epsilon": 0,
    "rope_theta": 1,
    "factor": 0,
    "beta_fast": 0,
    "beta_slow": 0,
    "partial_rotary_factor": 0,
}
# Lists of layers: indices (from their first index) or a kind per layer.
LAYER_INDEX_FIELDS = {"kda_layers": 1, "mlp_only_layers": 0}
LAYER_KIND_FIELDS = frozenset(
    {"layer_types", "mlp_layer_types", "indexer_types", "layers_block_type", "mtp_layers_block_type"}
)

# The largest count or size a config may declare, each far beyond any released model (the largest
# in brackets) and small enough that what eprt builds from a config before it reads a weight (a
# layer list, a name for every tensor, a rotary table of a head's width) stays a few MiB: a 1 KB
# config.json with 10^9 layers is refused by name, not after building 10^9 names.
MAX_LAYERS = 2**12  # decoder layers, and any step or index over them [Qwen3-235B-A22B: 94]
MAX_EXPERTS = 2**14  # routed or shared experts, top-k, expert groups [Qwen3-Next: 512]
MAX_VOCAB = 2**23  # [Gemma 3: 262144]
MAX_POSITIONS = 2**40  # positions a model was trained for, never allocated by [Kimi-Linear: 2^20]
MAX_WIDTH = 2**20  # any other width, head count, rank or kernel [DeepSeek-V3's intermediate: 18432]
# Routed experts over all MoE layers: each is three tensors to name and check before a weight is
# read, about 300 bytes of names [Kimi-K2: 60 x 384 = 23040].
MAX_ROUTED_EXPERTS = 2**18
ROUTED_EXPERT_FIELDS = frozenset({"num_experts", "num_local_experts", "n_routed_experts"})
# The bound of a field, by its name in config.json or in ModelConfig (MAX_WIDTH where unlisted).
LIMITS = {
    **dict.fromkeys(
        (
            "num_hidden_layers",
            "num_layers",
            "layers",
            "first_k_dense_replace",
            "num_nextn_predict_layers",
            "num_mtp_layers",
            "decoder_sparse_step",
            "moe_layer_freq",
            "full_attention_interval",
            "attn_res_block_size",
            "index_topk_freq",
            "index_skip_topk_offset",
        ),
        MAX_LAYERS,
    ),
    **dict.fromkeys(
        (
            "num_experts",
            "num_local_experts",
            "n_routed_experts",
            "num_experts_per_tok",
            "num_experts_per_token",
            "n_shared_experts",
            "num_shared_experts",
            "n_group",
            "num_expert_group",
            "topk_group",
        ),
        MAX_EXPERTS,
    ),
    "vocab_size": MAX_VOCAB,
    **dict.fromkeys(
        ("max_position_embeddings", "model_max_length", "original_max_position_embeddings", "index_topk", "topk"),
        MAX_POSITIONS,
    ),
}


def is_number(v: Any) -> bool:
    """An int or float, and not a bool (which Python counts as an int)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def is_integer(v: Any) -> bool:
    """A whole number, however JSON spelt it (`4096` or `4096.0`; 1e400 reads as infinity)."""
    return isinstance(v, int) and not isinstance(v, bool) or isinstance(v, float) and v.is_integer()


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
        """`value` if it has the type and the range field `name` needs (bool is no number here,
        whatever Python says); a count outside its range is refused before anything is built of it."""
        if name in INTEGER_FIELDS:
            if not is_integer(value):
                raise self.refuse(
                    f"field {name!r} is {value!r} ({type(value).__name__}); it must be an integer: "
                    "write it as a JSON number"
                )
            value = self.in_range(name, int(value))
            layers = self.d.get("num_hidden_layers")
            if name in ROUTED_EXPERT_FIELDS and is_integer(layers) and layers * value > MAX_ROUTED_EXPERTS:
                raise self.refuse(
                    f"field {name!r} is {value} in each of up to {int(layers)} layers (num_hidden_layers)"
                    f": over the {MAX_ROUTED_EXPERTS} routed experts eprt reads in a model, each three "
                    "tensors to name before a weight is read: fix them to the model's values"
                )
            return value
        if name in REAL_FIELDS:
            if not is_number(value):
                raise self.refuse(
                    f"field {name!r} is {value!r} ({type(value).__name__}); it must be a number: "
                    "write it as a JSON number"
                )
            if not math.isfinite(value) or value <= REAL_ABOVE.get(name, -math.inf):
                above = f" above {REAL_ABOVE[name]}" if name in REAL_ABOVE else ""
                raise self.refuse(
                    f"field {name!r} is {value!r}; it must be a finite number{above}: fix it to the model's value"
                )
            return float(value)
        if name in LAYER_INDEX_FIELDS or name in LAYER_KIND_FIELDS:
            return self.layer_list(name, value)
        return value

    def in_range(self, name: str, value: int, low: int | None = None, high: int | None = None) -> int:
        low = (0 if name in ZERO_ALLOWED else 1) if low is None else low
        high = LIMITS.get(name, MAX_WIDTH) if high is None else high
        if not low <= value <= high:
            shown = value if abs(value) < 10**18 else f"a {len(str(abs(value)))}-digit number"
            raise self.refuse(
                f"field {name!r} is {shown}; it must be from {low} to {high} (the bound is far above "
                "any released model): fix it to the model's value"
            )
        return value

    def layer_list(self, name: str, value: Any) -> list:
        """A list of at most MAX_LAYERS layer indices (LAYER_INDEX_FIELDS) or layer kinds (strings)."""
        indices = name in LAYER_INDEX_FIELDS
        well_typed = isinstance(value, list) and all(is_integer(x) if indices else isinstance(x, str) for x in value)
        if not well_typed:
            raise self.refuse(
                f"field {name!r} is {value!r:.80}; it must be a JSON list of "
                f"{'layer indices' if indices else 'layer kinds (strings)'}"
            )
        if len(value) > MAX_LAYERS:
            raise self.refuse(
                f"field {name!r} lists {len(value)} layers, over the {MAX_LAYERS} eprt reads: fix it "
                "to the model's layers"
            )
        if indices:
            return [self.in_range(name, int(x), LAYER_INDEX_FIELDS[name], MAX_LAYERS) for x in value]
        return value

    def integer(self, name: str, default: int | type[ConfigError], low: int, high: int) -> int:
        """An integer field only some families read, from `low` to `high`; `default` ConfigError: required."""
        value = self.get(name, default=default)
        if not is_integer(value):
            raise self.refuse(f"field {name!r} is {value!r}; it must be an integer: write it as a JSON number")
        return self.in_range(name, int(value), low, high)

    def positive(self, name: str, default: float | type[ConfigError] = ConfigError) -> float:
        """A positive finite number only some families read; without a default: required."""
        value = self.get(name, default=default)
        if not is_number(value) or not 0 < value < float("inf"):
            raise self.refuse(f"field {name!r} is {value!r}; it must be a positive number: fix it to the model's value")
        return float(value)

    def experts_per_token(self, num_experts: int, *names: str, default: int) -> int:
        """How many routed experts each token goes to: 1 to `num_experts` in a model with experts."""
        top_k = self.get(*names, default=default)
        if num_experts and not 1 <= top_k <= num_experts:
            spelled = next((n for n in names if n in self.d), names[0])
            raise self.refuse(
                f"field {spelled!r} is {top_k}; each token goes to 1 to {num_experts} routed experts "
                "(the model's expert count): set it in that range"
            )
        return top_k

    def refuse(self, msg: str) -> ConfigError:
        return ConfigError(f"{self.source}: {msg}")


def vlm_text_config(hf: dict, source: str) -> dict:
    """A vision-language model's `text_config`: its language model's config, with the fields the VLM
    sets for it on its top level (`tie_word_embeddings`)."""
    text = dict(Fields(hf, source).get("text_config"))
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text
