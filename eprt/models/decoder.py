"""The decoder-only causal LM the families share: embed, N x (attention, MLP) with pre-norm
residuals, final norm, head. A family file chooses the attention and the MLP of each layer, or
passes a decoder of its own (Kimi's, without rotary embeddings, with attention residuals)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from eprt.config import ModelConfig
from eprt.models.balance import Balance, pre_norm_groups
from eprt.models.layers import Linear, RMSNorm, linear
from eprt.models.moe import MoE
from eprt.models.rope import Rotary


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class DecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, self_attn: nn.Module, mlp: nn.Module):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        carry, m = self.attend(x, cos, sin)
        return carry + self.mlp(m)

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before the MLP: (the residual the MLP's output is added to, the MLP's input)."""
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x, self.post_attention_layernorm(x)

    def ffn(self) -> nn.Module:
        return self.mlp

    def balance_groups(self) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): each norm's, with the mixer that reads it."""
        return pre_norm_groups(self.input_layernorm, self.self_attn) + pre_norm_groups(
            self.post_attention_layernorm, self.mlp
        )


class Decoder(nn.Module):
    """input_ids [B, T] -> final hidden states [B, T, D]."""

    def __init__(self, c: ModelConfig, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.rotary = Rotary(c.rotary_dim, c.rope.theta, c.rope.yarn, c.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(input_ids.shape[1], x.dtype, x.device)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.final(x, [])

    def final(self, x: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The decoder's output from the last layer's hidden states (and block snapshots): what
        the head reads. A layer-by-layer run calls it after its last layer."""
        return self.norm(x)

    def layer_args(self, seq_len: int, dtype: torch.dtype, device, blocks: list[torch.Tensor]) -> tuple:
        """What every layer takes after its input for sequences of `seq_len` tokens: the rotary tables."""
        return self.rotary(seq_len, dtype, device)


class CausalLM(nn.Module):
    """`model(input_ids)` ([B, T] int64, causal, no padding) -> logits [B, T, vocab]."""

    def __init__(self, c: ModelConfig, layers: list[nn.Module], decoder: type[nn.Module] = Decoder):
        super().__init__()
        self.config = c
        self.model = decoder(c, layers)
        # Tied embeddings: the head reads model.embed_tokens.weight and has no tensor of its own.
        self.lm_head = None if c.tie_word_embeddings else Linear(c.hidden_size, c.vocab_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.logits(self.model(input_ids))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head over the decoder's output."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return linear(h, head.weight)

    def decoder(self) -> tuple[str, nn.Module]:
        """(the prefix of its tensor names, the decoder): what a layer-by-layer run walks."""
        return "model.", self.model

    def moe_blocks(self) -> list[tuple[int, MoE]]:
        return [
            (i, block)
            for i, layer in enumerate(self.model.layers)
            for block in layer.children()
            if isinstance(block, MoE)
        ]

    def set_dispatcher(self, make_dispatcher: Callable[[int, MoE], Callable]) -> None:
        """Install `make_dispatcher(layer_index, block)` as the dispatcher of every MoE block."""
        for i, block in self.moe_blocks():
            block.dispatcher = make_dispatcher(i, block)
