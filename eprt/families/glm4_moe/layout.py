"""GLM-4.5 / GLM-4.6 / GLM-4.7: the Hugging Face tensor layout, the checkpoint's tensors as eprt reads and writes them."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.families.deepseek_v3 import layout as deepseek_v3
from eprt.layout import Layout, gqa_attention


def layout(c: ModelConfig) -> Layout:
    return deepseek_v3.with_mtp(c, gqa_attention)
