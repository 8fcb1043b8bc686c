"""Kimi-K2.5 (and K2.6, K2.7): a vision-language checkpoint whose language model is DeepSeek-V3."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.families.deepseek_v3.model import DeepseekV3ForCausalLM
from eprt.models.vlm import LanguageModelOf


class KimiK25ForConditionalGeneration(LanguageModelOf):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(DeepseekV3ForCausalLM(c, expert_range))
