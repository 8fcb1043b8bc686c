"""Kimi-K2.5 / K2.6 / K2.7 (`kimi_k25`): a vision-language checkpoint around a DeepSeek-V3 text
model. The text config is `text_config`, its tensors are under `language_model.`; the vision
tower and the projector (`vision_tower.*`, `mm_projector.*`) are carried through unchanged."""

from __future__ import annotations

import dataclasses

from eprt.config import ModelConfig
from eprt.config_fields import vlm_text_config
from eprt.families.deepseek_v3 import config as deepseek_v3


def parse(hf: dict, source: str) -> ModelConfig:
    text = deepseek_v3.parse(vlm_text_config(hf, source), f"{source} (text_config)")
    return dataclasses.replace(text, family="kimi_k25", model_type=hf["model_type"])
