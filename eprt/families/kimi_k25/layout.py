"""Kimi-K2.5: the Hugging Face tensor layout, the checkpoint's tensors as eprt reads and writes them."""

from __future__ import annotations

import dataclasses
import re

from eprt.config import ModelConfig
from eprt.families.deepseek_v3 import layout as deepseek_v3
from eprt.layout import Layout

PREFIX = "language_model."


VISION = (r"vision_tower\..+", r"mm_projector\..+")


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
