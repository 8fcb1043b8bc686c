"""Qwen3-Next (and the language model of Qwen3.5-MoE).

Most layers are Gated DeltaNet, linear attention with one decay per head; every few a full GQA
layer whose output is gated per head and whose rotary embeddings cover part of each head. The
MLP is softmax-routed experts plus a shared expert behind a sigmoid gate. Every RMSNorm outside
the linear attention scales by (1 + weight).
"""

from __future__ import annotations

from torch import nn

from eprt.config import ModelConfig
from eprt.models.attention import GQAttention
from eprt.models.decoder import CausalLM, Decoder, DecoderLayer, attention_then_mlp
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


def qwen_next_layer(c: ModelConfig, i: int, expert_range: tuple[int, int] | None) -> DecoderLayer:
    g, norm = c.qwen_next.gated_delta_net, ZeroCenteredRMSNorm
    if i not in g.layers:
        return DecoderLayer(*attention_then_mlp(c, GQAttention(c, norm=norm), mlp(c, i, expert_range), norm=norm))
    linear_attn = GatedDeltaNet(
        c.hidden_size,
        g.key_heads,
        g.value_heads,
        g.key_head_dim,
        g.value_head_dim,
        g.conv_kernel,
        g.split_projections,
        c.rms_norm_eps,
    )
    # The checkpoint names a linear-attention layer's mixer linear_attn and a full one self_attn.
    blocks = attention_then_mlp(
        c, linear_attn, mlp(c, i, expert_range), mixer_name="linear_attn", rotary=False, norm=norm
    )
    return DecoderLayer(*blocks)


class Qwen3NextDecoder(Decoder):
    """The shared decoder with a (1 + weight) final norm (its rotary tables cover `c.rotary_dim`)."""

    def __init__(self, c: ModelConfig, layers: list[DecoderLayer]):
        super().__init__(c, layers)
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)


class Qwen3NextForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(
            c, [qwen_next_layer(c, i, expert_range) for i in range(c.num_layers)], decoder=Qwen3NextDecoder
        )
