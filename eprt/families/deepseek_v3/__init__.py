"""DeepSeek-V3 and Kimi-K2 (`deepseek_v3`): MLA; sigmoid noaux_tc experts plus shared experts; MTP layers."""

from eprt.families.deepseek_v3 import config, layout, model
from eprt.families.family import COMMON_UNQUANTIZED, Family

# the router computes in fp32, with its correction bias
ROUTER_FP32 = (r".*\.mlp\.gate\.weight", r".*\.e_score_correction_bias")
# an MTP layer's own embedding and head are an embedding and an lm_head; vLLM and SGLang build
# its eh_proj as a plain torch Linear, which cannot load a quantized weight
MTP_UNQUANTIZED = (*COMMON_UNQUANTIZED, r".*\.embed_tokens", r".*\.shared_head\.head", r".*\.eh_proj")

FAMILY = Family(
    "deepseek_v3",
    ("deepseek_v3", "kimi_k2"),
    config.parse,
    layout.layout,
    model.DeepseekV3ForCausalLM,
    fp32=ROUTER_FP32,
    unquantized=MTP_UNQUANTIZED,
    mtp_model=model.DeepseekV3MTP,
)
