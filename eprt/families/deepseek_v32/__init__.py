"""DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3 plus DeepSeek Sparse Attention's lightning indexer."""

from eprt.families.deepseek_v3 import ROUTER_FP32
from eprt.families.deepseek_v32 import config, layout, model
from eprt.families.family import COMMON_UNQUANTIZED, Family

FAMILY = Family(
    "deepseek_v32",
    ("deepseek_v32",),
    config.parse,
    layout.layout,
    model.DeepseekV32ForCausalLM,
    fp32=ROUTER_FP32,  # DeepSeek-V3's router
    # The lightning indexer's projections stay unquantized in every recipe: vLLM fuses `wk` with
    # `weights_proj` into one unquantized Linear (a block-FP8 `wk` is upcast to bf16 as it loads)
    # and both vLLM and SGLang build `weights_proj` without a quantization config; `wq_b` is
    # excluded with them, so that each engine loads the whole indexer as the source held it.
    unquantized=(*COMMON_UNQUANTIZED, r".*\.self_attn\.indexer\.(wq_b|wk|weights_proj)"),
)
