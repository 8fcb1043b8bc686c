"""Kimi-VL (`kimi_vl`: Kimi-VL-A3B Instruct and Thinking): a DeepSeek-V3 language model under
`language_model.` beside the MoonViT tower, run as Kimi-K2.5's; DeepSeek-V3's router and
unquantized set under `language_model.`."""

from eprt.families import deepseek_v3
from eprt.families.family import language_model_of
from eprt.families.kimi_k25.layout import under_language_model
from eprt.families.kimi_k25.model import KimiK25ForConditionalGeneration
from eprt.families.kimi_vl import config, layout

FAMILY = language_model_of(
    deepseek_v3.FAMILY,
    under_language_model,
    name="kimi_vl",
    model_types=("kimi_vl",),
    parse=config.parse,
    tensors=layout.layout,
    model=KimiK25ForConditionalGeneration,  # Kimi-VL's language model is Kimi-K2.5's: DeepSeek-V3
)
