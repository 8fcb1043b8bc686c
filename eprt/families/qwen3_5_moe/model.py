"""Qwen3.5-MoE as released: a vision-language checkpoint whose language model is Qwen3-Next's
(`model.language_model.*`, the head `lm_head`). The vision tower is not modeled; its tensors
travel through convert and export untouched. The text model saved alone runs as `qwen3_next`."""

from __future__ import annotations

import torch
from torch import nn

from eprt.config import ModelConfig
from eprt.families.qwen3_next.model import Qwen3NextDecoder, qwen_next_layer
from eprt.models.decoder import CausalLM, DecoderLayer


class LanguageModelInside(nn.Module):
    """`model.language_model`: the decoder, where the checkpoint keeps it."""

    def __init__(self, c: ModelConfig, layers: list[DecoderLayer]):
        super().__init__()
        self.language_model = Qwen3NextDecoder(c, layers)

    @property
    def layers(self) -> nn.ModuleList:
        return self.language_model.layers

    @property
    def embed_tokens(self) -> nn.Module:
        return self.language_model.embed_tokens

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.language_model(input_ids)


class Qwen3_5MoeForConditionalGeneration(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(
            c, [qwen_next_layer(c, i, expert_range) for i in range(c.num_layers)], decoder=LanguageModelInside
        )

    def decoder(self) -> tuple[str, nn.Module]:
        return "model.language_model.", self.model.language_model
