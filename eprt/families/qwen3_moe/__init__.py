"""Qwen3-MoE (`qwen3_moe`): GQA with q/k norm; softmax top-k experts, no shared experts."""

from eprt.families.family import Family
from eprt.families.qwen3_moe import config, layout, model

FAMILY = Family("qwen3_moe", ("qwen3_moe",), config.parse, layout.layout, model.Qwen3MoeForCausalLM)
