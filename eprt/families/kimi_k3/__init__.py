"""Kimi-K3 (`kimi_k3`): Kimi-Linear's language model with the K3 additions under `language_model.`,
the vision tower carried through."""

from eprt.families import kimi_linear
from eprt.families.family import language_model_of
from eprt.families.kimi_k3 import config, layout, model
from eprt.families.kimi_k25.layout import under_language_model

FAMILY = language_model_of(
    kimi_linear.FAMILY,
    under_language_model,
    name="kimi_k3",
    model_types=("kimi_k3",),
    parse=config.parse,
    tensors=layout.layout,
    model=model.KimiK3ForConditionalGeneration,
)
