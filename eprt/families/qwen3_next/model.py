"""Qwen3-Next (and the language model of Qwen3.5-MoE).

Most layers are Gated DeltaNet, linear attention with one decay per head; every few a full GQA
layer whose output is gated per head and whose rotary embeddings cover part of each head. The
MLP is softmax-routed experts plus a shared expert behind a sigmoid gate. Every RMSNorm outside
the linear attention scales by (1 + weight).
"""

from __future__ import annotations

import torch
from torch import nn

from eprt.config import ModelConfig
from eprt.models.attention import GQAttention
from eprt.models.balance import Balance, pre_norm_groups
from eprt.models.decoder import CausalLM, Decoder
from eprt.models.gated_delta import GatedDeltaNet
from eprt.models.layers import GatedMLP, ZeroCenteredRMSNorm
from eprt.models.moe import Experts, GatedSharedExpertMoE, held_experts
from eprt.models.router import SoftmaxRouter


def mlp(c: ModelConfig, i: int, expert_range: tuple[int, int] | None) -> nn.Module:
    D = c.hidden_size
    if not c.is_moe(i):
        return GatedMLP(D, c.intermediate_size)
    m = c.moe
    first, count = held_experts(expert_range, m.num_experts)
    return GatedSharedExpertMoE(
        SoftmaxRouter(m.num_experts, D, m.num_experts_per_tok, m.norm_topk_prob),
        Experts(m.num_experts, first, count, D, m.intermediate_size),
        GatedMLP(D, c.qwen_next.shared_expert_intermediate_size),
        D,
    )


class Qwen3NextDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, i: int, expert_range: tuple[int, int] | None):
        super().__init__()
        g = c.qwen_next.gated_delta_net
        self.input_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        # The checkpoint names a linear-attention layer's mixer linear_attn and a full one self_attn.
        self.is_linear = i in g.layers
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(
                c.hidden_size,
                g.key_heads,
                g.value_heads,
                g.key_head_dim,
                g.value_head_dim,
                g.conv_kernel,
                g.split_projections,
                c.rms_norm_eps,
            )
        else:
            self.self_attn = GQAttention(c, norm=ZeroCenteredRMSNorm)
        self.post_attention_layernorm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)
        self.mlp = mlp(c, i, expert_range)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        carry, m = self.attend(x, cos, sin)
        return carry + self.mlp(m)

    def attend(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before the MLP: (the residual the MLP's output is added to, the MLP's input)."""
        h = self.input_layernorm(x)
        x = x + (self.linear_attn(h) if self.is_linear else self.self_attn(h, cos, sin))
        return x, self.post_attention_layernorm(x)

    def ffn(self) -> nn.Module:
        return self.mlp

    def balance_groups(self) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): each norm's, with the mixer that reads it."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        return pre_norm_groups(self.input_layernorm, mixer) + pre_norm_groups(self.post_attention_layernorm, self.mlp)


class Qwen3NextDecoder(Decoder):
    """The shared decoder with a (1 + weight) final norm (its rotary tables cover `c.rotary_dim`)."""

    def __init__(self, c: ModelConfig, layers: list[Qwen3NextDecoderLayer]):
        super().__init__(c, layers)
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3NextForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(
            c, [Qwen3NextDecoderLayer(c, i, expert_range) for i in range(c.num_layers)], decoder=Qwen3NextDecoder
        )
