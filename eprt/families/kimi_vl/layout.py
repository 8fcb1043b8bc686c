"""Kimi-VL's tensors: DeepSeek-V3's under `language_model.`, its MoonViT tower and projector carried."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.families.deepseek_v3 import layout as deepseek_v3
from eprt.families.kimi_k25 import layout as kimi_k25
from eprt.layout import Layout

VISION = (r"vision_tower\..+", r"multi_modal_projector\..+")


def layout(c: ModelConfig) -> Layout:
    return kimi_k25.vlm_layout(deepseek_v3.layout(c), VISION)
