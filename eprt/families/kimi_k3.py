"""Kimi-K3 (`kimi_k3`): a vision-language checkpoint whose language model is `kimi_linear` with
the K3 additions (K3.md). The text config is `text_config`, its tensors are under
`language_model.`; the vision tower and the projector are carried through unchanged."""

from __future__ import annotations

import math

from eprt.config import FamilyReader, Fields, ModelConfig, register
from eprt.families import kimi_linear
from eprt.families.kimi_k25 import text_config, vlm_layout
from eprt.layout import Layout

# K3 stores A_log as a flat vector padded to 128 entries (96 heads in the release); the heads
# use the first entries.
A_LOG_PAD = 128


def parse(hf: dict, source: str) -> ModelConfig:
    text = text_config(hf, source)
    where = f"{source} (text_config)"
    f = Fields(text, where)
    lin = Fields(f.get("linear_attn_config", default={}), where + " (linear_attn_config)")
    heads = lin.get("num_heads") if lin.has("num_heads") else f.get("linear_num_heads", default=None)
    return kimi_linear.parse_text(text, where, "kimi_k3", model_type=hf["model_type"],
                                  a_log_len=A_LOG_PAD * math.ceil((heads or 1) / A_LOG_PAD))


def layout(c: ModelConfig) -> Layout:
    return vlm_layout(kimi_linear.layout(c))


READER = register(FamilyReader("kimi_k3", ("kimi_k3",), parse, layout))
