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

from eprt.config import ModelConfig
from eprt.config_fields import vlm_text_config
from eprt.families.qwen3_next import config as qwen3_next


def parse_text(hf: dict, source: str) -> ModelConfig:
    return qwen3_next.parse_text(hf, source, "qwen3_5_moe_text", split_projections=True, every_layer_moe=True)


def parse(hf: dict, source: str) -> ModelConfig:
    text = parse_text(vlm_text_config(hf, source), f"{source} (text_config)")
    return dataclasses.replace(text, family="qwen3_5_moe", model_type=hf["model_type"])
