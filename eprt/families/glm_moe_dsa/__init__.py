"""GLM-5 / 5.1 / 5.2 / 5.3 (`glm_moe_dsa`, 744B): the family entry. DeepSeek-V3.2's router in fp32
and its indexer unquantized (eprt.families.DEEPSEEK_V32 says why: the engines load GLM-5 with
DeepSeek-V3.2's model code)."""

from __future__ import annotations

from eprt.families import DEEPSEEK_V32, Family
from eprt.families.glm_moe_dsa import config, layout

FAMILY = Family(
    "glm_moe_dsa",
    ("glm_moe_dsa",),
    config.parse,
    layout.layout,
    fp32=DEEPSEEK_V32.fp32,
    unquantized=DEEPSEEK_V32.unquantized,
)
