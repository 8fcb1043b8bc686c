"""Mistral-Small-4 (119B): DeepSeek-V3's MLA and MoE with Llama-4's attention temperature and a
softmax router; released as a vision-language checkpoint (`mistral3` around a `mistral4` text
model: `mistral4_vlm`) in per-tensor FP8 with its experts fused. `mistral4` is the language model
saved alone."""

from __future__ import annotations

from eprt.families import Family, language_model_of
from eprt.families.mistral4 import config, layout

FAMILY = Family(config.FAMILY, ("mistral4",), config.parse, layout.layout)
VLM_FAMILY = language_model_of(FAMILY, config.VLM_FAMILY, ("mistral3",), config.parse_vlm, layout.vlm_layout)
