"""Kimi-K3: a vision-language checkpoint whose language model is Kimi-Linear with the K3 additions."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.families.kimi_linear.model import KimiLinearForCausalLM
from eprt.models.vlm import LanguageModelOf


class KimiK3ForConditionalGeneration(LanguageModelOf):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(KimiLinearForCausalLM(c, expert_range))
