"""Mistral-Small-4 (`mistral4`, 119B): DeepSeek-V3's MLA and MoE with Llama-4's attention
temperature and a softmax router; released in per-tensor FP8 with its experts fused."""

from __future__ import annotations

from eprt.families import Family
from eprt.families.mistral4 import config, layout

FAMILY = Family("mistral4", ("mistral4",), config.parse, layout.layout)
