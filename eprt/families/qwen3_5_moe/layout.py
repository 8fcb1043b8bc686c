"""Qwen3.5-MoE (the VLM as released, and its language model saved alone): the Hugging Face tensor layout, the checkpoint's tensors as eprt reads and writes them."""

from __future__ import annotations

import dataclasses
import re

from eprt.config import ModelConfig
from eprt.families.qwen3_next import layout as qwen3_next
from eprt.layout import Layout

TEXT, VLM = "model.", "model.language_model."


CARRIED = (r"mtp\..+",)  # the multi-token-prediction layers: carried, not run


VISION = (r"model\.visual\..+",)


def text_layout(c: ModelConfig) -> Layout:
    text = qwen3_next.layout(c)
    return dataclasses.replace(text, passthrough=(*text.passthrough, *CARRIED))


def under_language_model(name: str) -> str:
    return VLM + name[len(TEXT) :] if name.startswith(TEXT) else name


def patterns_under_language_model(patterns: tuple[str, ...]) -> tuple[str, ...]:
    """Regexes over the text model's names, as regexes over the same names in the VLM."""
    old, new = re.escape(TEXT), re.escape(VLM)
    return tuple(new + p[len(old) :] if p.startswith(old) else p for p in patterns)


def layout(c: ModelConfig) -> Layout:
    """The text layout with `model.` moved under `model.language_model.`."""
    text = qwen3_next.layout(c)
    return Layout(
        tuple(
            dataclasses.replace(
                s,
                name=under_language_model(s.name),
                sources=tuple(map(under_language_model, s.sources)),
                fused=s.fused and under_language_model(s.fused),
                alias=s.alias and under_language_model(s.alias),
            )
            for s in text.specs
        ),
        passthrough=(*text.passthrough, *CARRIED, *VISION),
    )
