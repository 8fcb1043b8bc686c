"""Nemotron-H and Nemotron-3 (`nemotron_h`: Nano 30B-A3B, Super 120B-A12B, Ultra 550B-A55B) and the
language model of Nemotron-H-Omni (`nemotron_h_omni`'s `llm_config` / `text_config`): config.json
as a ModelConfig (the tensor layout is layout.py).

Each layer is one mixer behind one RMSNorm, as `layers_block_type` (transformers 5) or
`hybrid_override_pattern` (the release: M Mamba-2, * attention, - MLP, E MoE) lists them: Mamba-2,
grouped-query attention without positional encoding, a dense relu² MLP, or a MoE of relu² experts
(not gated) chosen by a sigmoid router with a correction bias and expert groups, beside one shared
expert; Super and Ultra route in a latent (`moe_latent_size`: fc1_latent_proj / fc2_latent_proj
around the routed experts). Super and Ultra ship a multi-token-prediction step (`mtp.layers.N`, as
`mtp_layers_block_type` lists them: attention then MoE), which eprt runs as vLLM's NemotronHMTP does
(eprt.families.nemotron_h.mtp).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from eprt.config import FamilyConfig, GQAConfig, ModelConfig, moe_or_dense, own_config, read_kv_heads
from eprt.config_fields import MAX_LAYERS, Fields, is_number, vlm_text_config

FAMILY, OMNI_FAMILY = "nemotron_h", "nemotron_h_omni"
MAMBA, ATTENTION, MLP, MOE = "linear_attention", "full_attention", "mlp", "moe"
# The release's one-letter spelling of the layer kinds, and transformers 4's names of two of them
PATTERN = {"M": MAMBA, "*": ATTENTION, "-": MLP, "E": MOE}
LEGACY = {"mamba": MAMBA, "attention": ATTENTION}


@dataclass(frozen=True)
class Mamba2Config:
    """The Mamba-2 layers' sizes: `heads` heads of `head_dim` channels, a state of `state_size` per
    head, B and C shared within each of `groups` groups of heads, a causal conv of `conv_kernel`
    taps (with a bias under `conv_bias`), time steps clamped to [dt_min, dt_max] (dt_max None:
    unbounded), the scan run `chunk_size` tokens at a time."""

    heads: int
    head_dim: int
    state_size: int
    groups: int
    conv_kernel: int
    conv_bias: bool
    dt_min: float
    dt_max: float | None
    chunk_size: int

    @property
    def conv_dim(self) -> int:
        """The conv's channels: the scan's input x, then B and C."""
        return self.heads * self.head_dim + 2 * self.groups * self.state_size


@own_config(FAMILY, OMNI_FAMILY)
@dataclass(frozen=True)
class NemotronHConfig(FamilyConfig):
    """What only Nemotron-H has (the module docstring): each layer's kind, the Mamba-2 sizes, the
    shared expert's width, the routed experts' latent (None: they read the hidden state), and the
    kinds of the multi-token-prediction step's layers."""

    layer_kinds: tuple[str, ...]
    mamba: Mamba2Config
    shared_intermediate_size: int
    latent_size: int | None
    mtp_layer_kinds: tuple[str, ...]

    def routed_width(self) -> int | None:
        return self.latent_size

    def attention_bytes(self, seq_len: int, itemsize: int) -> int:
        """A Mamba-2 mixer's transients for one sequence of T tokens (eprt.models.mamba2), which a
        layer of attention does not hold at once with them: in_proj's output, the conv's padded
        input and output, the time steps, x, B and C widened to fp32, the scan's outputs (per
        chunk and joined), the D skip, the gated norm's four fp32 temporaries, out_proj's input;
        and one chunk's [H, L, L] decays and scores, B and C widened per head, and the [H, P, N]
        state before and after."""
        m, T, b = self.mamba, seq_len, itemsize
        inner, L = m.heads * m.head_dim, min(m.chunk_size, seq_len)
        whole = T * b * (2 * inner + 3 * m.conv_dim + m.heads) + 4 * T * (
            8 * inner + m.heads + 2 * m.groups * m.state_size
        )
        chunk = 4 * (5 * m.heads * L * L + 2 * L * m.heads * m.state_size + 2 * m.heads * m.head_dim * m.state_size)
        return whole + chunk if MAMBA in self.layer_kinds else 0


def layer_kinds(f: Fields, list_field: str, pattern_field: str, default: list[str] | None) -> list[str]:
    """The kinds of the layers, from transformers' list or the release's pattern string."""
    if f.has(list_field):
        kinds = [LEGACY.get(k, k) for k in f.get(list_field)]
    elif f.has(pattern_field):
        pattern = f.get(pattern_field)
        if not isinstance(pattern, str) or len(pattern) > MAX_LAYERS or set(pattern) - set(PATTERN):
            raise f.refuse(
                f"field {pattern_field!r} is {pattern!r:.80}; it must be a string of at most {MAX_LAYERS} "
                f"layer letters, each one of {''.join(PATTERN)} (Mamba-2, attention, MLP, MoE)"
            )
        kinds = [PATTERN[ch] for ch in pattern]
    elif default is not None:
        kinds = default
    else:
        raise f.refuse(f"required field {list_field} / {pattern_field} is missing")
    unknown = sorted(set(kinds) - set(PATTERN.values()))
    if unknown:
        raise f.refuse(f"{list_field} holds {unknown}; each layer is one of {sorted(PATTERN.values())}")
    return kinds


def time_step_limit(f: Fields) -> tuple[float, float | None]:
    """The time steps' clamp, [low, high]: high may be infinite (JSON Infinity, or transformers 5's
    {"__float__": "Infinity"}), read as None."""
    value = f.get("time_step_limit", "mamba_dt_limit", default=[0.0, math.inf])
    bounds = [float(b["__float__"]) if isinstance(b, dict) and "__float__" in b else b for b in value]
    if len(bounds) != 2 or not all(is_number(b) for b in bounds) or not 0 <= bounds[0] <= bounds[1]:
        raise f.refuse(f"time_step_limit is {value!r:.80}; it must be [low, high] with 0 <= low <= high")
    return float(bounds[0]), None if math.isinf(bounds[1]) else float(bounds[1])


def refuse_unmodeled(f: Fields) -> None:
    """The switches eprt does not run (every release leaves them off), each refused by name."""
    for name, what in (
        ("use_bias", "biases on the Mamba projections"),
        ("mlp_bias", "biases on the MLPs and latent projections"),
        ("attention_bias", "biases on the attention projections"),
        ("residual_in_fp32", "an fp32 residual stream"),
    ):
        if f.get(name, default=False):
            raise f.refuse(f"{name} is true; eprt runs Nemotron-H without {what}, as released")
    for name, want in (("mlp_hidden_act", "relu2"), ("mamba_hidden_act", "silu")):
        if f.get(name, default=want) != want:
            raise f.refuse(f"{name} is {f.get(name)!r}; Nemotron-H uses {want}")
    if f.get("n_shared_experts", default=1) != 1:
        raise f.refuse("n_shared_experts is not 1; every Nemotron-H MoE layer has one shared expert")


def refuse_unrunnable_mtp(f: Fields, count: int, kinds: list[str]) -> None:
    """The multi-token prediction eprt runs, as vLLM's NemotronHMTP builds it: one step whose layers
    are attention and MoE (a MoE only last, where the calibration runs a routed block)."""
    if count != 1:
        raise f.refuse(
            f"num_nextn_predict_layers is {count}; Nemotron-H's multi-token prediction is one step of the "
            "mtp_layers_block_type layers (vLLM's NemotronHMTP runs one): set it to 1 or 0"
        )
    if set(kinds) - {ATTENTION, MOE} or MOE in kinds[:-1]:
        raise f.refuse(
            f"the MTP layers are {kinds}; eprt runs Nemotron-H's MTP step as vLLM builds it, attention "
            "and MoE layers, a MoE only last"
        )


def parse(hf: dict, source: str, family: str = FAMILY) -> ModelConfig:
    f = Fields(hf, source)
    refuse_unmodeled(f)
    kinds = layer_kinds(f, "layers_block_type", "hybrid_override_pattern", [MAMBA, MOE, ATTENTION, MLP])
    mtp_count = f.get("num_nextn_predict_layers", default=0)
    mtp_kinds = layer_kinds(f, "mtp_layers_block_type", "mtp_hybrid_override_pattern", [ATTENTION, MOE])
    if mtp_count:
        refuse_unrunnable_mtp(f, mtp_count, mtp_kinds)
    n_heads = f.get("num_attention_heads", default=32)
    n_experts = f.get("n_routed_experts", "num_local_experts", default=8)
    heads, groups = f.get("mamba_num_heads", default=128), f.get("n_groups", "mamba_n_groups", default=8)
    if heads % groups:
        raise f.refuse(f"mamba_num_heads {heads} is not a multiple of n_groups {groups}: B and C serve groups of heads")
    dt_min, dt_max = time_step_limit(f)
    mamba = Mamba2Config(
        heads=heads,
        head_dim=f.get("mamba_head_dim", default=64),
        state_size=f.get("ssm_state_size", default=128),
        groups=groups,
        conv_kernel=f.get("conv_kernel", "mamba_d_conv", default=4),
        conv_bias=bool(f.get("use_conv_bias", "mamba_conv_bias", default=True)),
        dt_min=dt_min,
        dt_max=dt_max,
        chunk_size=f.get("chunk_size", "mamba_chunk_size", default=128),
    )
    moe_layers = [i for i, k in enumerate(kinds) if k == MOE]
    head_dim = f.get("head_dim", default=128)
    return ModelConfig(
        family=family,
        model_type=hf["model_type"],
        vocab_size=f.get("vocab_size", default=131072),
        hidden_size=f.get("hidden_size", default=4096),
        num_layers=len(kinds),
        num_heads=n_heads,
        rms_norm_eps=float(f.get("layer_norm_epsilon", default=1e-5)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=f.get("intermediate_size", default=21504) if MLP in kinds else 0,
        max_position_embeddings=f.get("max_position_embeddings", default=4096),
        rope=None,  # no layer encodes positions: Mamba-2 orders the tokens
        gqa=GQAConfig(
            num_kv_heads=read_kv_heads(f, n_heads, default=8),
            head_dim=head_dim,
            rotary_dim=0,
            qk_norm=False,
            qkv_bias=False,
            output_bias=False,
        ),
        moe=moe_or_dense(
            moe_layers,
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(n_experts, "num_experts_per_tok", default=2),
            intermediate_size=f.get("moe_intermediate_size", default=7688),
            num_shared_experts=0,  # its one shared expert has a width of its own: NemotronHConfig's
            router="sigmoid",
            norm_topk_prob=bool(f.get("norm_topk_prob", default=True)),
            routed_scaling_factor=float(f.get("routed_scaling_factor", default=1.0)),
            n_group=f.get("n_group", default=1),
            topk_group=f.get("topk_group", default=1),
        ),
        own=NemotronHConfig(
            layer_kinds=tuple(kinds),
            mamba=mamba,
            shared_intermediate_size=f.get("moe_shared_expert_intermediate_size", default=7688),
            latent_size=f.get("moe_latent_size", default=None) if moe_layers else None,
            mtp_layer_kinds=tuple(mtp_kinds * mtp_count),
        ),
        num_nextn_predict_layers=mtp_count,
    )


def parse_omni(hf: dict, source: str) -> ModelConfig:
    """Nemotron-H-Omni: its language model's config (`llm_config` as released, `text_config` as
    transformers 5 saves it), under the VLM's family and model_type."""
    f = Fields(hf, source)
    field = "text_config" if f.has("text_config") else "llm_config"
    text = vlm_text_config({**hf, "text_config": f.get(field)}, source)
    config = parse({**text, "model_type": hf["model_type"]}, f"{source} ({field})", OMNI_FAMILY)
    return dataclasses.replace(config, model_type=hf["model_type"])
