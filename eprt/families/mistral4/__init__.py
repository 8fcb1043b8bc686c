"""Mistral-Small-4 (119B): DeepSeek-V3's MLA and MoE with Llama-4's attention temperature and a
softmax router; released as a vision-language checkpoint (`mistral3` around a `mistral4` text
model: `mistral4_vlm`) in per-tensor FP8 with its experts fused. `mistral4` is the language model
saved alone."""

from eprt.families.family import Family, language_model_of
from eprt.families.kimi_k25.layout import under_language_model
from eprt.families.mistral4 import config, layout, model

FAMILY = Family(config.FAMILY, ("mistral4",), config.parse, layout.layout, model.Mistral4ForCausalLM)
VLM_FAMILY = language_model_of(
    FAMILY,
    under_language_model,
    name=config.VLM_FAMILY,
    model_types=("mistral3",),
    parse=config.parse_vlm,
    tensors=layout.vlm_layout,
    model=model.Mistral4ForConditionalGeneration,
)
