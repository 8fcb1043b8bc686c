"""Kimi-K3 (`kimi_k3`): a vision-language checkpoint whose language model is `kimi_linear` with
the K3 additions (docs/models.md, 'Kimi-K3'). The text config is `text_config`, its tensors are under
`language_model.`; the vision tower and the projector are carried through unchanged."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.config_fields import vlm_text_config
from eprt.families.kimi_linear import config as kimi_linear


def parse(hf: dict, source: str) -> ModelConfig:
    # A_log is a vector of any length from one entry per head: the release pads it to 128 entries
    # for its 96 heads, and the heads use the first ones (kimi_linear.a_log)
    return kimi_linear.parse_text(
        vlm_text_config(hf, source), f"{source} (text_config)", "kimi_k3", model_type=hf["model_type"], flat_a_log=True
    )
