"""Llama-4 (Scout 16E, Maverick 128E): the text-only checkpoint (`llama4_text`) and the language model
of the vision-language release (`llama4`). Config: config.py; tensors: layout.py; model: model.py."""

from __future__ import annotations

from eprt.families.family import COMMON_UNQUANTIZED, Family, language_model_of
from eprt.families.kimi_k25.layout import under_language_model
from eprt.families.llama4 import config, layout, model

# vLLM builds the router as a ReplicatedLinear without a quantization config
TEXT_FAMILY = Family(
    config.TEXT_FAMILY,
    (config.TEXT_FAMILY,),
    config.parse_text,
    layout.text_layout,
    model.Llama4ForCausalLM,
    unquantized=(*COMMON_UNQUANTIZED, r".*\.feed_forward\.router"),
)
FAMILY = language_model_of(
    TEXT_FAMILY,
    under_language_model,
    name=config.VLM_FAMILY,
    model_types=(config.VLM_FAMILY,),
    parse=config.parse,
    tensors=layout.layout,
    model=model.Llama4ForConditionalGeneration,
)
