"""Qwen3.5-MoE: two entries, one folder. `qwen3_5_moe` is the release (a VLM: the language model
under `model.language_model.`, the vision tower carried); `qwen3_5_moe_text` is its language
model saved alone, which runs as Qwen3-Next's model with the projections stored apart."""

from eprt.families import qwen3_next
from eprt.families.family import Family
from eprt.families.qwen3_5_moe import config, layout, model
from eprt.families.qwen3_next.model import Qwen3NextForCausalLM

TEXT_FAMILY = Family(
    "qwen3_5_moe_text",
    ("qwen3_5_moe_text",),
    config.parse_text,
    layout.text_layout,
    Qwen3NextForCausalLM,
    unquantized=qwen3_next.FAMILY.unquantized,
)
FAMILY = Family(
    "qwen3_5_moe",
    ("qwen3_5_moe",),
    config.parse,
    layout.layout,
    model.Qwen3_5MoeForConditionalGeneration,
    unquantized=layout.patterns_under_language_model(qwen3_next.FAMILY.unquantized),
)
