"""Llama-4 (Scout 16E, Maverick 128E): the text-only checkpoint (`llama4_text`) and the language model
of the vision-language release (`llama4`). Config: config.py; tensors: layout.py; model: model.py."""

from __future__ import annotations

from eprt.families import COMMON_UNQUANTIZED, Family, language_model_of
from eprt.families.llama4 import config, layout

# vLLM builds the router as a ReplicatedLinear without a quantization config
TEXT = Family(
    config.TEXT_FAMILY,
    (config.TEXT_FAMILY,),
    config.parse_text,
    layout.text_layout,
    unquantized=(*COMMON_UNQUANTIZED, r".*\.feed_forward\.router"),
)
VLM = language_model_of(TEXT, config.VLM_FAMILY, (config.VLM_FAMILY,), config.parse, layout.layout)
