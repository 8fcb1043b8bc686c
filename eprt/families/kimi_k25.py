"""Kimi-K2.5 / K2.6 / K2.7 (`kimi_k25`): a vision-language checkpoint around a DeepSeek-V3 text
model. The text config is `text_config`, its tensors are under `language_model.`; the vision
tower and the projector (`vision_tower.*`, `mm_projector.*`) are carried through unchanged."""

from __future__ import annotations

import dataclasses
import re

from eprt.config import ModelConfig
from eprt.config_fields import Fields
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


def vlm_layout(text: Layout, vision: tuple[str, ...] = VISION) -> Layout:
    """A text model's layout under `language_model.`, the vision tower and projector (`vision`,
    regexes over their names) carried through."""
    return Layout(
        tuple(
            dataclasses.replace(
                s,
                name=PREFIX + s.name,
                sources=tuple(PREFIX + n for n in s.sources),
                fused=s.fused and PREFIX + s.fused,
                alias=s.alias and PREFIX + s.alias,
            )
            for s in text.specs
        ),
        passthrough=(*under_language_model(text.passthrough), *vision),
    )


def under_language_model(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """Regexes over a text model's names, as regexes over the same names under `language_model.`."""
    return tuple(re.escape(PREFIX) + p for p in patterns)


def layout(c: ModelConfig) -> Layout:
    return vlm_layout(deepseek_v3.layout(c))
