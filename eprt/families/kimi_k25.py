"""Kimi-K2.5 / K2.6 / K2.7 (`kimi_k25`): a vision-language checkpoint around a DeepSeek-V3 text
model. The text config is `text_config`, its tensors are under `language_model.`; the vision
tower and the projector (`vision_tower.*`, `mm_projector.*`) are carried through unchanged."""

from __future__ import annotations

import dataclasses
import re

from eprt.config import FamilyReader, Fields, ModelConfig, register
from eprt.families import deepseek_v3
from eprt.layout import Layout

PREFIX = "language_model."
VISION = (r"vision_tower\..+", r"mm_projector\..+")


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


def vlm_layout(text: Layout) -> Layout:
    """A text model's layout under `language_model.`, the vision tower and projector carried through."""
    escaped = re.escape(PREFIX)
    return Layout(
        tuple(dataclasses.replace(s, name=PREFIX + s.name, sources=tuple(PREFIX + n for n in s.sources))
              for s in text.specs),
        passthrough=(*(escaped + p for p in text.passthrough), *VISION),
        precise=tuple(escaped + p for p in text.precise),
        unquantized=tuple(escaped + p for p in text.unquantized),
    )


def layout(c: ModelConfig) -> Layout:
    return vlm_layout(deepseek_v3.layout(c))


READER = register(FamilyReader("kimi_k25", ("kimi_k25",), parse, layout))
