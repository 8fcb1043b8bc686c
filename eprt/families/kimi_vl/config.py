"""Kimi-VL (`kimi_vl`: Kimi-VL-A3B Instruct and Thinking; remote code, no transformers class): a
DeepSeek-V3 language model (`text_config`, model_type deepseek_v3) beside the MoonViT vision tower,
read as Kimi-K2.5's: the language model's tensors under `language_model.`, the vision tower and the
projector (`vision_tower.*`, `multi_modal_projector.*`) carried through unchanged."""

from __future__ import annotations

import dataclasses

from eprt.config import ModelConfig
from eprt.config_fields import vlm_text_config
from eprt.families.deepseek_v3 import config as deepseek_v3


def parse(hf: dict, source: str) -> ModelConfig:
    text = deepseek_v3.parse(vlm_text_config(hf, source), f"{source} (text_config)")
    return dataclasses.replace(text, family="kimi_vl", model_type=hf["model_type"])
