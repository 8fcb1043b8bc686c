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
from eprt.models.attn_res import attn_res_mix
from eprt.models.balance import Balance, pre_norm_groups
from eprt.models.decoder import CausalLM, Embedding
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


class KimiDecoderLayer(nn.Module):
    def __init__(self, c: ModelConfig, i: int, expert_range: tuple[int, int] | None):
        super().__init__()
        D, eps = c.hidden_size, c.rms_norm_eps
        self.input_layernorm = RMSNorm(D, eps)
        self.self_attn = attention(c, i)
        self.post_attention_layernorm = RMSNorm(D, eps)
        # The checkpoint names a routed layer's MLP block_sparse_moe and a dense one mlp.
        if c.is_moe(i):
            self.block_sparse_moe = sparse_moe(c, expert_range)
        else:
            self.mlp = GatedMLP(D, c.intermediate_size, activation(c))
        block_size = c.kimi_linear.attn_res_block_size
        self.attn_res = bool(block_size)
        if self.attn_res:
            self.starts_block = i % block_size == 0
            self.self_attention_res_norm, self.self_attention_res_proj = RMSNorm(D, eps), Linear(D, 1)
            self.mlp_res_norm, self.mlp_res_proj = RMSNorm(D, eps), Linear(D, 1)

    def ffn(self) -> nn.Module:
        return self.block_sparse_moe if hasattr(self, "block_sparse_moe") else self.mlp

    def balance_groups(self) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): each norm's, with the mixer that reads it."""
        return pre_norm_groups(self.input_layernorm, self.self_attn) + pre_norm_groups(
            self.post_attention_layernorm, self.ffn()
        )

    def forward(self, x: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        carry, m = self.attend(x, blocks)
        return carry + self.ffn()(m)

    def attend(self, x: torch.Tensor, blocks: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Everything before the MLP: (the residual the MLP's output is added to, the MLP's input).
        A block's first layer appends its input to `blocks`."""
        if not self.attn_res:
            x = x + self.self_attn(self.input_layernorm(x))
            return x, self.post_attention_layernorm(x)
        # x is the partial sum of the current block; a block's first layer files it as a
        # snapshot and starts a new sum from its own output.
        h = attn_res_mix(blocks, x, self.self_attention_res_norm, self.self_attention_res_proj)
        y = self.self_attn(self.input_layernorm(h))
        if self.starts_block:
            blocks.append(x)
        else:
            y = x + y
        h = attn_res_mix(blocks, y, self.mlp_res_norm, self.mlp_res_proj)
        return y, self.post_attention_layernorm(h)


class KimiDecoder(nn.Module):
    """input_ids [B, T] -> final hidden states [B, T, D]; no positional embedding anywhere."""

    def __init__(self, c: ModelConfig, layers: list[KimiDecoderLayer]):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.attn_res = bool(c.kimi_linear.attn_res_block_size)
        if self.attn_res:
            self.output_attn_res_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
            self.output_attn_res_proj = Linear(c.hidden_size, 1)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        blocks: list[torch.Tensor] = []
        for layer in self.layers:
            x = layer(x, blocks)
        return self.final(x, blocks)

    def final(self, x: torch.Tensor, blocks: list[torch.Tensor]) -> torch.Tensor:
        """The output from the last layer's hidden states and the block snapshots: what the head reads."""
        if self.attn_res:
            x = attn_res_mix(blocks, x, self.output_attn_res_norm, self.output_attn_res_proj)
        return self.norm(x)

    def layer_args(self, seq_len: int, dtype: torch.dtype, device, blocks: list[torch.Tensor]) -> tuple:
        """What every layer takes after its input: the sequence's attention-residual block snapshots."""
        return (blocks,)


class KimiLinearForCausalLM(CausalLM):
    # The router, its correction bias and the decay parameters compute in fp32 in the reference.
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(c, [KimiDecoderLayer(c, i, expert_range) for i in range(c.num_layers)], decoder=KimiDecoder)
