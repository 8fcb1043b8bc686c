"""GLM-5: DeepSeek-V3.2's decoder whose indexer rotates interleaved, and whose layers marked
"shared" run no indexer of their own: each attends to the keys the last layer that ran one picked.
The decoder carries those keys from layer to layer in one list per forward (the layer-by-layer
run, eprt.quant.loop.engine, carries it per sequence in its LayerState)."""

from __future__ import annotations

import torch

from eprt.config import ModelConfig
from eprt.models.decoder import CausalLM, Decoder, DecoderLayer
from eprt.models.deepseek_v3 import deepseek_mlp
from eprt.models.dsa import Indexer
from eprt.models.mla import MLAttention


class GlmMoeDsaLayer(DecoderLayer):
    def __init__(self, c: ModelConfig, i: int, expert_range: tuple[int, int] | None):
        self.shares_index = c.own.shares_index(i)
        indexer = None if self.shares_index else Indexer(c, interleaved_rope=True)
        super().__init__(c, MLAttention(c, indexer=indexer), deepseek_mlp(c, i, expert_range))
        # the layer-by-layer run keeps what a full layer leaves in the list for the layers after it
        self.passes_on = not self.shares_index

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, picked: list) -> torch.Tensor:
        carry, m = self.attend(x, cos, sin, picked)
        return carry + self.mlp(m)

    def attend(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, picked: list
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`picked`: [the keep [B, T, T] of the last full layer], which a full layer replaces with
        its own. Layer 0 is full (the config reader refuses a file that marks it shared), so a
        shared layer finds it filled in every run of the layers in order; the time probe, which
        runs one layer of each kind alone, hands a shared one an empty list and it attends to
        every earlier key, at the same cost."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, picked)
        return x, self.post_attention_layernorm(x)


class GlmMoeDsaDecoder(Decoder):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(input_ids.shape[1], x.dtype, x.device)
        picked: list[torch.Tensor] = []
        for layer in self.layers:
            x = layer(x, cos, sin, picked)
        return self.final(x, [])

    def layer_args(self, seq_len: int, dtype: torch.dtype, device, carried: list[torch.Tensor]) -> tuple:
        """The rotary tables and the sequence's carried keep (the list a full layer refills)."""
        return (*self.rotary(seq_len, dtype, device), carried)


class GlmMoeDsaForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        layers = [GlmMoeDsaLayer(c, i, expert_range) for i in range(c.num_layers)]
        super().__init__(c, layers, decoder=GlmMoeDsaDecoder)
