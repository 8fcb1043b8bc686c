"""MiniMax-M3 (`minimax_m3_vl`): the language model of the vision-language checkpoint as released,
and (`minimax_m3_vl_text`) the language model alone as transformers saves it. Config in config.py,
tensors in layout.py, the model in model.py."""

from eprt.families.family import COMMON_UNQUANTIZED, Family, language_model_of
from eprt.families.kimi_k25.layout import under_language_model
from eprt.families.minimax_m3_vl import config, layout, model

TEXT_FAMILY = Family(
    config.TEXT_FAMILY,
    (config.TEXT_FAMILY,),
    config.parse_text_only,
    layout.layout,
    model.MiniMaxM3ForCausalLM,
    # the router computes in fp32, with its correction bias
    fp32=(r".*\.(mlp|block_sparse_moe)\.gate\.weight", r".*\.e_score_correction_bias"),
    # the indexer's projections: vLLM builds them without a quantization config
    unquantized=(*COMMON_UNQUANTIZED, r".*\.block_sparse_moe\.gate", r".*\.self_attn\.(indexer\.|index_)(q|k)_proj"),
)
FAMILY = language_model_of(
    TEXT_FAMILY,
    under_language_model,
    name=config.VLM_FAMILY,
    model_types=(config.VLM_FAMILY,),
    parse=config.parse,
    tensors=layout.layout,
    model=model.MiniMaxM3ForConditionalGeneration,
)
