"""Kimi-Linear (`kimi_linear`): KDA linear attention between MLA layers; sigmoid-routed experts."""

from eprt.families.family import COMMON_UNQUANTIZED, Family
from eprt.families.kimi_linear import config, layout, model

FAMILY = Family(
    "kimi_linear",
    ("kimi_linear",),
    config.parse,
    layout.layout,
    model.KimiLinearForCausalLM,
    # the router, its correction bias and KDA's decay parameters compute in fp32
    fp32=(
        r".*\.block_sparse_moe\.gate\.weight",
        r".*\.e_score_correction_bias",
        r".*\.self_attn\.A_log",
        r".*\.self_attn\.dt_bias",
    ),
    # the engines build these unquantized (docs/export.md, 'Exclusions'): the router, the latent
    # projections of the routed experts, the attention-residual queries
    unquantized=(
        *COMMON_UNQUANTIZED,
        r".*\.block_sparse_moe\.gate",
        r".*\.routed_expert_(down|up)_proj",
        r".*_res_proj",
    ),
)
