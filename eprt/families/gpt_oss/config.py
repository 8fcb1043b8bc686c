"""GPT-OSS's config.json (`gpt_oss`: gpt-oss-20b and gpt-oss-120b) as a ModelConfig.

GPT-OSS is GQA with a learned sink logit per head and biases on q/k/v/o; its layers alternate
between attention over a sliding window of `sliding_window` keys and full causal attention
(`layer_types`, else transformers' rule: sliding first, then every other layer). Every layer is a
MoE: a router with a bias picks the top k experts by logit and weighs them by the softmax of those
k logits; each expert is a clamped SwiGLU (alpha `swiglu_alpha`, clamp `swiglu_limit`, up + 1) with
a bias on each projection. RoPE is YaRN (the release's factor 32 over 4096 positions, untruncated).
"""

from __future__ import annotations

from dataclasses import dataclass

from eprt.config import FamilyConfig, GQAConfig, ModelConfig, moe_or_dense, own_config, read_rope
from eprt.config_fields import MAX_POSITIONS, Fields, is_integer
from eprt.layout import ClampedSwiGLU

FAMILY = "gpt_oss"
SLIDING, FULL = "sliding_attention", "full_attention"
DEFAULT_THETA = 150000.0  # transformers' GptOssConfig.default_theta
# transformers' GptOssConfig default, which the release's config.json states as well
DEFAULT_ROPE = {
    "rope_type": "yarn",
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "truncate": False,
    "original_max_position_embeddings": 4096,
}


@own_config(FAMILY)
@dataclass(frozen=True)
class GptOssConfig(FamilyConfig):
    """What only GPT-OSS has: the layers that attend over a sliding window of `sliding_window` keys
    (the others attend to every earlier key) and the experts' clamped SwiGLU. Every attention has sinks."""

    sliding_layers: tuple[int, ...]
    sliding_window: int
    swiglu_alpha: float
    swiglu_limit: float

    @property
    def activation(self) -> ClampedSwiGLU:
        return ClampedSwiGLU(self.swiglu_alpha, self.swiglu_limit)

    def attention_bytes(self, seq_len: int, itemsize: int) -> int:
        """The boolean masks a sliding or sinked attention builds beside SDPA's own: the causal mask,
        the window, their conjunction and its copy with the sink's column."""
        return 4 * seq_len * (seq_len + 1)


def _sliding_layers(f: Fields, n_layers: int) -> tuple[int, ...]:
    """The sliding-window layers: `layer_types`, else transformers' rule (even layers slide)."""
    types = f.get("layer_types", default=None)
    if types is None:
        return tuple(range(0, n_layers, 2))
    if not isinstance(types, list) or len(types) != n_layers or any(t not in (SLIDING, FULL) for t in types):
        raise f.refuse(
            f"field 'layer_types' is {types!r:.80}; GPT-OSS gives each of its {n_layers} layers {SLIDING!r} or {FULL!r}"
        )
    return tuple(i for i, t in enumerate(types) if t == SLIDING)


def parse(hf: dict, source: str) -> ModelConfig:
    f = Fields(hf, source)
    n_layers = f.get("num_hidden_layers")
    n_heads, hidden = f.get("num_attention_heads", default=64), f.get("hidden_size", default=2880)
    head_dim = f.get("head_dim", default=64)
    n_experts = f.get("num_local_experts", "num_experts", default=128)
    if not n_experts:
        raise f.refuse("num_local_experts is 0; every GPT-OSS layer is a MoE")
    sliding = _sliding_layers(f, n_layers)
    window = f.get("sliding_window", default=128)
    if sliding and (not is_integer(window) or not 1 <= window <= MAX_POSITIONS):
        raise f.refuse(
            f"field 'sliding_window' is {window!r}; the {SLIDING} layers need a window of 1 to "
            f"{MAX_POSITIONS} keys: set it (the releases use 128)"
        )
    bias = bool(f.get("attention_bias", default=True))
    rope_fields = hf if f.has("rope_parameters", "rope_scaling") else {**hf, "rope_parameters": DEFAULT_ROPE}
    own = GptOssConfig(
        sliding_layers=sliding,
        sliding_window=int(window) if sliding else 0,
        swiglu_alpha=f.positive("swiglu_alpha", 1.702),
        swiglu_limit=f.positive("swiglu_limit", 7.0),
    )
    return ModelConfig(
        family=FAMILY,
        model_type=hf.get("model_type", FAMILY),
        vocab_size=f.get("vocab_size", default=201088),
        hidden_size=hidden,
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=0,  # no dense MLP layers
        max_position_embeddings=f.get("max_position_embeddings", default=131072),
        rope=read_rope(Fields(rope_fields, source), DEFAULT_THETA),
        gqa=GQAConfig(
            num_kv_heads=f.get("num_key_value_heads", default=8),
            head_dim=head_dim,
            rotary_dim=head_dim,
            qk_norm=False,
            qkv_bias=bias,
            output_bias=bias,
        ),
        moe=moe_or_dense(
            range(n_layers),
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(n_experts, "num_experts_per_tok", "experts_per_token", default=4),
            intermediate_size=f.get("intermediate_size", default=2880),
            num_shared_experts=0,
            router="softmax",
            norm_topk_prob=True,  # the softmax runs over the chosen k alone: their weights sum to 1
        ),
        own=own,
    )
