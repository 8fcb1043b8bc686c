"""MiniMax-M3 (`minimax_m3_vl`): the language model of the vision-language checkpoint as released,
and (`minimax_m3_vl_text`) the language model alone as transformers saves it. Config in config.py,
tensors in layout.py, the model in model.py."""

from __future__ import annotations

from eprt.families import COMMON_UNQUANTIZED, Family, language_model_of
from eprt.families.minimax_m3_vl.config import TEXT_FAMILY, VLM_FAMILY, parse, parse_text_only
from eprt.families.minimax_m3_vl.layout import layout

TEXT = Family(
    TEXT_FAMILY,
    (TEXT_FAMILY,),
    parse_text_only,
    layout,
    # the router computes in fp32, with its correction bias
    fp32=(r".*\.(mlp|block_sparse_moe)\.gate\.weight", r".*\.e_score_correction_bias"),
    # the indexer's projections: vLLM builds them without a quantization config
    unquantized=(*COMMON_UNQUANTIZED, r".*\.block_sparse_moe\.gate", r".*\.self_attn\.(indexer\.|index_)(q|k)_proj"),
)
VLM = language_model_of(TEXT, VLM_FAMILY, (VLM_FAMILY,), parse, layout)
FAMILIES = (TEXT, VLM)
