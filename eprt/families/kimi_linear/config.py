"""Kimi-Linear (and Kimi-K3's language model, also `kimi_linear`): reading config.json (the tensor layout is layout.py).

Fields are read in Moonshot's spelling (`linear_attn_config`, `num_experts_per_token`,
`moe_renormalize`, ...) or in transformers' (`layer_types`, `linear_num_heads`,
`num_experts_per_tok`, ...). The Kimi-K3 fields (SiTU, latent experts, attention residuals, the
MLA output gate, the KDA gate lower bound and full-rank gate) are read where present.
"""

from __future__ import annotations

from dataclasses import dataclass

from eprt.config import (
    FamilyConfig,
    KDAConfig,
    KimiLinearConfig,
    ModelConfig,
    SiTUConfig,
    moe_or_dense,
    own_config,
)
from eprt.config_fields import Fields
from eprt.families.deepseek_v3 import config as deepseek_v3

# Where a field is absent: transformers' KimiLinearConfig for Kimi-Linear, mlx-lm's kimi_k3 for
# Kimi-K3's language model (the two disagree on these).
DEFAULTS = {
    "kimi_linear": {"first_k_dense_replace": 1, "routed_scaling_factor": 2.446, "num_experts_per_token": 8},
    "kimi_k3": {"first_k_dense_replace": 0, "routed_scaling_factor": 1.0, "num_experts_per_token": 16},
}


@own_config("kimi_linear", "kimi_k3")
@dataclass(frozen=True)
class LatentExperts(FamilyConfig):
    """Kimi-K3's latent MoE (`routed_expert_hidden_size`): the routed experts compute in a latent
    of `latent_size`, projected down from and up to the hidden state, their combined output
    normalized first under `latent_norm`. Absent (`ModelConfig.own` None): the experts read the
    hidden state, as Kimi-Linear's do."""

    latent_size: int
    latent_norm: bool

    def routed_width(self) -> int:
        return self.latent_size


def parse(hf: dict, source: str) -> ModelConfig:
    return parse_text(hf, source, "kimi_linear")


def parse_text(
    hf: dict, source: str, family: str, model_type: str | None = None, flat_a_log: bool = False
) -> ModelConfig:
    """The normalized config of a kimi_linear text config; `flat_a_log` when A_log is a vector
    of at least one entry per head (Kimi-K3), else Moonshot's [1, 1, heads, 1]."""
    f = Fields(hf, source)
    defaults = DEFAULTS[family]
    n_layers = f.get("num_hidden_layers")
    lin = Fields(f.get("linear_attn_config", default={}), source + " (linear_attn_config)")
    if lin.has("kda_layers"):
        kda_layers = [i - 1 for i in lin.get("kda_layers")]  # 1-based in the file
    else:
        kda_layers = [i for i, t in enumerate(f.get("layer_types")) if t == "linear_attention"]
    heads = lin.get("num_heads") if lin.has("num_heads") else f.get("linear_num_heads")
    head_dim = lin.get("head_dim") if lin.has("head_dim") else f.get("linear_head_dim")
    kernel = (
        lin.get("short_conv_kernel_size")
        if lin.has("short_conv_kernel_size")
        else f.get("linear_conv_kernel_dim", default=4)
    )

    act = f.get("hidden_act", default="silu")
    if act not in ("silu", "situ"):
        raise f.refuse(f"hidden_act {act!r} is not supported (Kimi-Linear uses silu, Kimi-K3 situ)")
    if not f.get("mla_use_nope", default=True):
        raise f.refuse("mla_use_nope is false; eprt runs Kimi's MLA layers without RoPE only")
    if f.get("moe_router_activation_func", default="sigmoid") != "sigmoid":
        raise f.refuse(f"moe_router_activation_func {hf['moe_router_activation_func']!r}; Kimi routes by sigmoid")
    n_heads = deepseek_v3.read_mla_heads(f)

    n_experts = f.get("num_experts", "num_local_experts", default=0)
    first_dense = f.get("first_k_dense_replace", default=defaults["first_k_dense_replace"])
    freq = f.get("moe_layer_freq", default=1)
    if family == "kimi_linear" and freq != 1:
        # transformers ignores it, Moonshot's code honours it: they agree only at 1
        raise f.refuse("moe_layer_freq != 1 is not supported (the reference implementations disagree on it)")
    if f.has("mlp_layer_types"):
        moe_layers = tuple(i for i, t in enumerate(f.get("mlp_layer_types")) if t == "sparse")
    else:
        moe_layers = tuple(i for i in range(n_layers) if n_experts and i >= first_dense and i % freq == 0)
    latent = f.get("routed_expert_hidden_size", default=None)
    situ = None
    if act == "situ":
        situ = SiTUConfig(
            beta=float(f.get("activation_situ_beta", default=1.0)),
            linear_beta=f.get("activation_situ_linear_beta", default=None),
        )
    return ModelConfig(
        family=family,
        model_type=model_type or hf["model_type"],
        vocab_size=f.get("vocab_size"),
        hidden_size=f.get("hidden_size"),
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-5)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=f.get("intermediate_size"),
        max_position_embeddings=f.get("model_max_length", "max_position_embeddings", default=1048576),
        rope=None,  # NoPE: no layer rotates
        mla=deepseek_v3.read_mla(f),  # the full-attention layers; kimi_linear.kda.layers are linear attention
        moe=moe_or_dense(
            moe_layers,
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(
                n_experts, "num_experts_per_token", "num_experts_per_tok", default=defaults["num_experts_per_token"]
            ),
            intermediate_size=f.get("moe_intermediate_size", default=0),
            num_shared_experts=f.get("num_shared_experts", "n_shared_experts", default=0),
            router="sigmoid",
            norm_topk_prob=bool(f.get("moe_renormalize", "norm_topk_prob", default=True)),
            routed_scaling_factor=float(f.get("routed_scaling_factor", default=defaults["routed_scaling_factor"])),
            n_group=f.get("num_expert_group", "n_group", default=1),
            topk_group=f.get("topk_group", default=1),
        ),
        own=LatentExperts(latent, bool(f.get("latent_moe_use_norm", default=False))) if latent and moe_layers else None,
        kimi_linear=KimiLinearConfig(
            kda=KDAConfig(
                layers=tuple(kda_layers),
                heads=heads,
                head_dim=head_dim,
                conv_kernel=kernel,
                a_log_shape=(heads,) if flat_a_log else (1, 1, heads, 1),
                gate_lower_bound=lin.get("gate_lower_bound", default=None),
                full_rank_gate=bool(lin.get("use_full_rank_gate", default=False)),
            ),
            mla_output_gate=bool(f.get("mla_use_output_gate", default=False)),
            situ=situ,
            attn_res_block_size=f.get("attn_res_block_size", default=None),
        ),
    )
