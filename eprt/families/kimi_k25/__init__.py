"""Kimi-K2.5 / K2.6 / K2.7 (`kimi_k25`): DeepSeek-V3's language model under `language_model.`, the
vision tower carried through."""

from eprt.families import deepseek_v3
from eprt.families.family import language_model_of
from eprt.families.kimi_k25 import config, layout, model

FAMILY = language_model_of(
    deepseek_v3.FAMILY,
    layout.under_language_model,
    name="kimi_k25",
    model_types=("kimi_k25",),
    parse=config.parse,
    tensors=layout.layout,
    model=model.KimiK25ForConditionalGeneration,
)
