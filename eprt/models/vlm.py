"""The language model of a vision-language checkpoint (Kimi-K2.5, Kimi-K3): the causal LM under
`language_model.`. The vision tower and the projector are not modeled; their tensors travel
through convert and export untouched."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from eprt.models.decoder import CausalLM
from eprt.models.moe import MoE


class LanguageModelOf(nn.Module):
    """`model(input_ids)` -> the language model's logits; parameter names carry `language_model.`."""

    def __init__(self, language_model: CausalLM):
        super().__init__()
        self.config = language_model.config
        self.language_model = language_model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model(input_ids)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return self.language_model.logits(h)

    def decoder(self) -> tuple[str, nn.Module]:
        prefix, decoder = self.language_model.decoder()
        return "language_model." + prefix, decoder  # the attribute above names its tensors

    def moe_blocks(self) -> list[tuple[int, MoE]]:
        return self.language_model.moe_blocks()

    def set_dispatcher(self, make_dispatcher: Callable[[int, MoE], Callable]) -> None:
        self.language_model.set_dispatcher(make_dispatcher)
