"""MiniMax-M2 / M2.5 / M2.7 (`minimax_m2`, 230B): the family's entry."""

from eprt.families.family import COMMON_UNQUANTIZED, Family
from eprt.families.minimax_m2 import config, layout, model

FAMILY = Family(
    config.NAME,
    ("minimax_m2",),
    config.parse,
    layout.layout,
    model.MiniMaxM2ForCausalLM,
    # the router computes in fp32 with its correction bias, as transformers and vLLM (params_dtype fp32) do
    fp32=(r".*\.block_sparse_moe\.gate\.weight", r".*\.e_score_correction_bias"),
    # vLLM builds the router as an unquantized ReplicatedLinear
    unquantized=(*COMMON_UNQUANTIZED, r".*\.block_sparse_moe\.gate"),
)
