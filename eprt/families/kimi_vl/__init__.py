"""Kimi-VL (`kimi_vl`): the family entry, DeepSeek-V3's router and unquantized set under `language_model.`."""

from __future__ import annotations

from eprt.families import DEEPSEEK_V3, language_model_of
from eprt.families.kimi_vl import config, layout

FAMILY = language_model_of(DEEPSEEK_V3, "kimi_vl", ("kimi_vl",), config.parse, layout.layout)
