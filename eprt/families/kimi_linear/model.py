"""Kimi-Linear and the language model of Kimi-K3.

Layers are Kimi Delta Attention (linear, per-channel decay) or NoPE MLA, as the config lists
them; after the first dense layers the MLP is sigmoid-routed experts plus shared experts.
Kimi-K3 adds, each when its config field is set: SiTU for SiLU, experts in a latent space,
the MLA output gate, the KDA gate lower bound, and attention residuals over blocks of layers.
"""

from __future__ import annotations

import torch
from torch import nn

from eprt.config import ModelConfig
from eprt.models.attn_res import AttentionResidualLayer, attn_res_mix
from eprt.models.decoder import CausalLM, Decoder, DecoderLayer, attention_then_mlp
from eprt.models.kda import KimiDeltaAttention
from eprt.models.layers import GatedMLP, Linear, RMSNorm, SiTU, silu_mul
from eprt.models.mla import MLAttention
from eprt.models.moe import Experts, LatentMoE, MoE, held_experts
from eprt.models.router import SigmoidGroupRouter


def activation(c: ModelConfig):
    situ = c.kimi_linear.situ
    return SiTU(situ.beta, situ.linear_beta) if situ else silu_mul


def attention(c: ModelConfig, i: int) -> nn.Module:
    k, kda = c.kimi_linear, c.kimi_linear.kda
    if i in kda.layers:
        return KimiDeltaAttention(
            c.hidden_size,
            kda.heads,
            kda.head_dim,
            kda.conv_kernel,
            kda.a_log_shape,
            kda.gate_lower_bound,
            kda.full_rank_gate,
            c.rms_norm_eps,
        )
    return MLAttention(c, output_gate=k.mla_output_gate)


def sparse_moe(c: ModelConfig, expert_range: tuple[int, int] | None) -> MoE:
    m = c.moe
    first, count = held_experts(expert_range, m.num_experts)
    D, I, latent = c.hidden_size, m.intermediate_size, c.own
    gate = SigmoidGroupRouter(
        m.num_experts, D, m.num_experts_per_tok, m.n_group, m.topk_group, m.norm_topk_prob, m.routed_scaling_factor
    )
    shared = GatedMLP(D, I * m.num_shared_experts, activation(c)) if m.num_shared_experts else None
    experts = Experts(m.num_experts, first, count, c.routed_width, I, activation(c))
    if latent:  # the family's own config: LatentExperts
        return LatentMoE(gate, experts, shared, D, latent.latent_size, c.rms_norm_eps if latent.latent_norm else None)
    return MoE(gate, experts, shared)


def kimi_layer(c: ModelConfig, i: int, expert_range: tuple[int, int] | None) -> DecoderLayer:
    # The checkpoint names a routed layer's MLP block_sparse_moe and a dense one mlp.
    if c.is_moe(i):
        mlp, mlp_name = sparse_moe(c, expert_range), "block_sparse_moe"
    else:
        mlp, mlp_name = GatedMLP(c.hidden_size, c.intermediate_size, activation(c)), "mlp"
    blocks = attention_then_mlp(c, attention(c, i), mlp, mlp_name=mlp_name, rotary=False)
    span = c.kimi_linear.attn_res_block_size
    if not span:
        return DecoderLayer(*blocks)
    return AttentionResidualLayer(
        *blocks,
        queries=("self_attention_res", "mlp_res"),
        starts_block=i % span == 0,
        width=c.hidden_size,
        eps=c.rms_norm_eps,
    )


class KimiDecoder(Decoder):
    """The shared decoder (no positional embedding anywhere), with attention residuals before the final norm."""

    def __init__(self, c: ModelConfig, layers: list[DecoderLayer]):
        super().__init__(c, layers)
        self.attn_res = bool(c.kimi_linear.attn_res_block_size)
        if self.attn_res:
            self.output_attn_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.output_attn_res_proj = Linear(c.hidden_size, 1)

    def final(self, x: torch.Tensor, snapshots: list[torch.Tensor]) -> torch.Tensor:
        if self.attn_res:
            x = attn_res_mix(snapshots, x, self.output_attn_res_norm, self.output_attn_res_proj)
        return self.norm(x)


class KimiLinearForCausalLM(CausalLM):
    # The router, its correction bias and the decay parameters compute in fp32 in the reference.
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(c, [kimi_layer(c, i, expert_range) for i in range(c.num_layers)], decoder=KimiDecoder)
