"""Llama-4's config.json (`llama4_text`, and the `text_config` of the `llama4` VLM) as a ModelConfig.

Llama-4 (Scout 16E, Maverick 128E) is GQA with three kinds of layer: most rotate (RoPE as complex
multiplication on interleaved pairs, Llama-3 frequency scaling on Scout) and attend within chunks of
`attention_chunk_size`, their queries and keys L2-normalized after RoPE (`use_qk_norm`); every
`no_rope_layer_interval`-th is a NoPE layer with full causal attention whose queries are scaled by
the attention temperature log1p(floor((pos + 1) / floor_scale)) * attn_scale + 1. MoE layers (every
`interleave_moe_layer_step`-th, or `moe_layers`) route each token to one expert by a sigmoid of its
router logit, which scales the expert's input, beside one shared expert; the other layers are dense
MLPs of `intermediate_size_mlp`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from eprt.config import (
    FamilyConfig,
    GQAConfig,
    ModelConfig,
    RopeConfig,
    moe_or_dense,
    own_config,
    read_rope,
    require_silu,
    rope_object,
)
from eprt.config_fields import MAX_LAYERS, MAX_POSITIONS, Fields, is_integer, vlm_text_config
from eprt.errors import ConfigError

TEXT_FAMILY, VLM_FAMILY = "llama4_text", "llama4"
DEFAULT_THETA = 500000.0  # transformers' Llama4TextConfig.default_theta
CHUNKED, FULL = "chunked_attention", "full_attention"


@dataclass(frozen=True)
class Llama3Rope:
    """Llama-3's RoPE frequency scaling (`rope_type: llama3`): long wavelengths divided by `factor`,
    short ones kept, the band between interpolated (eprt.models.rope.llama3_frequencies)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@own_config(TEXT_FAMILY, VLM_FAMILY)
@dataclass(frozen=True)
class Llama4Config(FamilyConfig):
    """The layer kinds and attention knobs only Llama-4 has (the module docstring)."""

    rope_layers: tuple[int, ...]  # the layers that rotate; the others are NoPE layers
    chunked_layers: tuple[int, ...]  # the layers that attend within chunks; the others attend to every earlier token
    attention_chunk_size: int
    qk_l2_norm: bool  # L2-normalize each head's query and key on the rope layers
    temperature_tuning: bool  # scale the NoPE layers' queries by the attention temperature
    floor_scale: float
    attn_scale: float
    llama3_rope: Llama3Rope | None = None


def _flags(f: Fields, name: str, n_layers: int) -> list[int] | None:
    """`no_rope_layers`: one 0 (NoPE) or 1 (rope) per layer, at least `n_layers` of them; None where absent or empty."""
    value = f.get(name, default=None)
    if not value:
        return None
    if (
        not isinstance(value, list)
        or len(value) < n_layers
        or any(isinstance(x, bool) or x not in (0, 1) for x in value)
    ):
        raise f.refuse(
            f"field {name!r} is {value!r:.80}; it must list 0 (NoPE) or 1 (RoPE) for each of the "
            f"{n_layers} layers (num_hidden_layers)"
        )
    return value[:n_layers]


def _layer_types(f: Fields, rotates: list[int], chunk: int | None, n_layers: int) -> list[str]:
    """Which layers attend within chunks: `layer_types` as transformers 5 writes it, else the rope
    layers where the model has a chunk size (transformers' own rule)."""
    types = f.get("layer_types", default=None)
    if types is None:
        return [CHUNKED if rope and chunk is not None else FULL for rope in rotates]
    if len(types) < n_layers or any(t not in (CHUNKED, FULL) for t in types):
        raise f.refuse(
            f"field 'layer_types' is {types!r:.80}; Llama-4 gives each of its {n_layers} layers {CHUNKED!r} or {FULL!r}"
        )
    if chunk is None and CHUNKED in types[:n_layers]:
        raise f.refuse(f"layer_types has {CHUNKED!r} layers but attention_chunk_size is null: set the chunk size")
    return types[:n_layers]


def _moe_layers(f: Fields, n_layers: int) -> list[int]:
    """The MoE layers as transformers reads them: `moe_layers` where the file lists them, else every
    `interleave_moe_layer_step`-th layer (Scout: 1, every layer; Maverick: 2). transformers writes both;
    vLLM reads the step alone, so a file whose two disagree is refused: its engines and transformers
    would build different models from one checkpoint."""
    step = f.integer("interleave_moe_layer_step", 1, 1, MAX_LAYERS)
    stepped = list(range(step - 1, n_layers, step))
    layers = f.get("moe_layers", default=None)
    if layers is None:
        return stepped
    if not isinstance(layers, list) or any(not is_integer(i) or not 0 <= i < n_layers for i in layers):
        raise f.refuse(f"field 'moe_layers' is {layers!r:.80}; it must list layer indices from 0 to {n_layers - 1}")
    layers = sorted(set(layers))
    if f.has("interleave_moe_layer_step") and layers != stepped:
        raise f.refuse(
            f"moe_layers {layers!r:.80} and interleave_moe_layer_step {step} disagree: transformers builds the "
            f"layers moe_layers lists, vLLM one every {step} layers ({stepped!r:.80}); correct the one that is wrong so "
            "that both name the model's MoE layers"
        )
    return layers


def _rope(f: Fields, hf: dict) -> tuple[RopeConfig, Llama3Rope | None]:
    """The RoPE base and, where the file asks for it (Scout), Llama-3's frequency scaling."""
    params = {**(rope_object(f, "rope_parameters") or {}), **(rope_object(f, "rope_scaling") or {})}
    if (params.get("rope_type") or params.get("type")) != "llama3":
        return read_rope(f, DEFAULT_THETA), None
    scoped = Fields(params, f"{f.source} (rope parameters)")
    # each required, as transformers' llama3 frequencies require them
    scaling = Llama3Rope(
        factor=scoped.positive("factor"),
        low_freq_factor=scoped.positive("low_freq_factor"),
        high_freq_factor=scoped.positive("high_freq_factor"),
        original_max_position_embeddings=scoped.integer(
            "original_max_position_embeddings", ConfigError, 1, MAX_POSITIONS
        ),
    )
    plain = {k: v for k, v in hf.items() if k not in ("rope_parameters", "rope_scaling")}
    if "rope_theta" in params:
        plain["rope_theta"] = params["rope_theta"]
    return read_rope(Fields(plain, f.source), DEFAULT_THETA), scaling


def parse_text(hf: dict, source: str, family: str = TEXT_FAMILY) -> ModelConfig:
    f = Fields(hf, source)
    n_layers = f.get("num_hidden_layers")
    require_silu(f, "Llama-4")
    n_experts = f.get("num_local_experts", default=16)
    top_k = f.experts_per_token(n_experts, "num_experts_per_tok", default=1)
    if top_k != 1:
        raise f.refuse(
            f"num_experts_per_tok is {top_k}; eprt runs Llama-4's top-1 routing (every release routes each token "
            "to one expert, whose input the router's score scales): set it to 1"
        )
    n_heads, hidden = f.get("num_attention_heads"), f.get("hidden_size")
    head_dim = f.get("head_dim", default=hidden // n_heads)
    bias = bool(f.get("attention_bias", default=False))
    interval = f.integer("no_rope_layer_interval", 4, 1, MAX_LAYERS)
    rotates = _flags(f, "no_rope_layers", n_layers) or [int((i + 1) % interval != 0) for i in range(n_layers)]
    chunk = hf.get("attention_chunk_size", 8192)  # null: no layer attends in chunks (absent: transformers' 8192)
    if chunk is not None:
        chunk = f.integer("attention_chunk_size", 8192, 1, MAX_POSITIONS)
    types = _layer_types(f, rotates, chunk, n_layers)
    rope, llama3 = _rope(f, hf)
    own = Llama4Config(
        rope_layers=tuple(i for i, r in enumerate(rotates) if r),
        chunked_layers=tuple(i for i, t in enumerate(types) if t == CHUNKED),
        attention_chunk_size=chunk or 0,
        qk_l2_norm=bool(f.get("use_qk_norm", default=True)),
        temperature_tuning=bool(f.get("attn_temperature_tuning", default=True)),
        floor_scale=f.positive("floor_scale", 8192.0),
        attn_scale=f.positive("attn_scale", 0.1),
        llama3_rope=llama3,
    )
    return ModelConfig(
        family=family,
        model_type=hf.get("model_type", family),
        vocab_size=f.get("vocab_size", default=202048),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=f.integer("intermediate_size_mlp", 16384, 1, 2**20),  # the dense layers' MLP
        max_position_embeddings=f.get("max_position_embeddings", default=4096 * 32),
        rope=rope,
        # the L2 norm has no weights: no q/k norm tensors
        gqa=GQAConfig(
            num_kv_heads=f.get("num_key_value_heads", default=n_heads),
            head_dim=head_dim,
            rotary_dim=head_dim,
            qk_norm=False,
            qkv_bias=bias,
            output_bias=bias,
        ),
        moe=moe_or_dense(
            _moe_layers(f, n_layers) if n_experts else [],
            num_experts=n_experts,
            num_experts_per_tok=top_k,
            intermediate_size=f.get("intermediate_size", default=8192),  # the routed and the shared expert's
            num_shared_experts=1,
            router="sigmoid_top1",
            norm_topk_prob=False,
        ),
        own=own,
    )


def parse(hf: dict, source: str) -> ModelConfig:
    """The `llama4` VLM: its language model's config, under the VLM's family and model_type."""
    text = parse_text(vlm_text_config(hf, source), f"{source} (text_config)", VLM_FAMILY)
    return dataclasses.replace(text, model_type=hf["model_type"])
