"""GLM-5 / 5.1 / 5.2 / 5.3 (`glm_moe_dsa`, 744B): DeepSeek-V3.2's model with GLM's dims, the
indexer's RoPE interleaved, and index sharing. DeepSeek-V3.2's router in fp32 and its indexer
unquantized (eprt.families.deepseek_v32.FAMILY says why: the engines load GLM-5 with DeepSeek-V3.2's
model code)."""

from eprt.families import deepseek_v32
from eprt.families.family import Family
from eprt.families.glm_moe_dsa import config, layout, model

FAMILY = Family(
    "glm_moe_dsa",
    ("glm_moe_dsa",),
    config.parse,
    layout.layout,
    model.GlmMoeDsaForCausalLM,
    fp32=deepseek_v32.FAMILY.fp32,
    unquantized=deepseek_v32.FAMILY.unquantized,
)
