"""Qwen3.5-MoE: the Qwen3-Next architecture with its linear attention's input projections stored
apart (in_proj_qkv, in_proj_z, in_proj_b, in_proj_a), experts in every layer and the top k always
renormalized.

`qwen3_5_moe` is the vision-language checkpoint as released: the text config is `text_config`,
the language model's tensors are under `model.language_model.` (the head stays `lm_head`), and
the vision tower (`model.visual.*`) and the multi-token-prediction layers (`mtp.*`) are carried
through unchanged. `qwen3_5_moe_text` is the language model saved alone (`model.*`).
"""

from __future__ import annotations

import dataclasses
import re

from eprt.config import ModelConfig
from eprt.config_fields import Fields
from eprt.families import qwen3_next
from eprt.layout import Layout

TEXT, VLM = "model.", "model.language_model."
CARRIED = (r"mtp\..+",)  # the multi-token-prediction layers: carried, not run
VISION = (r"model\.visual\..+",)


def parse_text(hf: dict, source: str) -> ModelConfig:
    return qwen3_next.parse_text(hf, source, "qwen3_5_moe_text", split_projections=True, every_layer_moe=True)


def text_layout(c: ModelConfig) -> Layout:
    text = qwen3_next.layout(c)
    return dataclasses.replace(text, passthrough=(*text.passthrough, *CARRIED))


def text_config(hf: dict, source: str) -> dict:
    """The language model's config, with the fields the VLM sets for it on its top level."""
    text = dict(Fields(hf, source).get("text_config"))
    if "tie_word_embeddings" not in text and "tie_word_embeddings" in hf:
        text["tie_word_embeddings"] = hf["tie_word_embeddings"]
    return text


def parse(hf: dict, source: str) -> ModelConfig:
    text = parse_text(text_config(hf, source), f"{source} (text_config)")
    return dataclasses.replace(text, family="qwen3_5_moe", model_type=hf["model_type"])


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
