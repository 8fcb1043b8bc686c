"""Kimi-K3: the Hugging Face tensor layout, the checkpoint's tensors as eprt reads and writes them."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.families.kimi_k25.layout import vlm_layout
from eprt.families.kimi_linear import layout as kimi_linear
from eprt.layout import Layout


def layout(c: ModelConfig) -> Layout:
    return vlm_layout(kimi_linear.layout(c))
