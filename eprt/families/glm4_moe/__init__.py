"""GLM-4.5 / GLM-4.6 (`glm4_moe`): DeepSeek-V3's MoE decoder and MTP layers around GQA."""

from eprt.families.deepseek_v3 import MTP_UNQUANTIZED, ROUTER_FP32
from eprt.families.deepseek_v3.model import DeepseekV3MTP
from eprt.families.family import Family
from eprt.families.glm4_moe import config, layout, model

# DeepSeek-V3's router and MTP layer
FAMILY = Family(
    "glm4_moe",
    ("glm4_moe",),
    config.parse,
    layout.layout,
    model.Glm4MoeForCausalLM,
    fp32=ROUTER_FP32,
    unquantized=MTP_UNQUANTIZED,
    mtp_model=DeepseekV3MTP,
)
