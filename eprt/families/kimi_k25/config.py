"""Kimi-K2.5 / K2.6 / K2.7 (`kimi_k25`): a vision-language checkpoint around a DeepSeek-V3 text
model. The text config is `text_config`, its tensors are under `language_model.`; the vision
tower and the projector (`vision_tower.*`, `mm_projector.*`) are carried through unchanged."""

from __future__ import annotations

import dataclasses

from eprt.config import ModelConfig
from eprt.config_fields import Fields
from eprt.families.deepseek_v3 import config as deepseek_v3


def text_config(hf: dict, source: str) -> dict:
    """The language model's config, with the fields the VLM sets for it on its top level."""
    f = Fields(hf, source)
    text = dict(f.get("text_config"))
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def parse(hf: dict, source: str) -> ModelConfig:
    text = deepseek_v3.parse(text_config(hf, source), f"{source} (text_config)")
    return dataclasses.replace(text, family="kimi_k25", model_type=hf["model_type"])
