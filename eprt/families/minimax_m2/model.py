"""MiniMax-M2: in every layer, grouped-query attention whose q/k RMSNorm spans the whole projection
(all heads as one vector) with partial rotate-half RoPE, then routed experts chosen by sigmoid
scores plus a correction bias (plain top-k, weights renormalized), no shared expert. The checkpoint
names the expert block `block_sparse_moe` and keeps the correction bias on the block, beside its
router."""

from __future__ import annotations

import torch
from torch import nn

from eprt.config import ModelConfig
from eprt.models.attention import GQAttention
from eprt.models.decoder import CausalLM, DecoderLayer, attention_then_mlp
from eprt.models.layers import linear
from eprt.models.moe import Experts, MoE, held_experts
from eprt.models.router import sigmoid_grouped_topk


class SigmoidTopKRouter(nn.Module):
    """s = sigmoid(x W^T) in fp32; s + the block's correction bias chooses the top k; the weights
    are the chosen s divided by their sum. The weight stays fp32, as in the reference."""

    def __init__(self, num_experts: int, hidden: int, k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.k = k

    def forward(self, x_TD: torch.Tensor, bias_E: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_TE = linear(x_TD.float(), self.weight.float())
        return sigmoid_grouped_topk(logits_TE, bias_E, self.k, 1, 1, renormalize=True, scaling=1.0)


class MiniMaxM2MoE(MoE):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None):
        m = c.moe
        first, count = held_experts(expert_range, m.num_experts)
        super().__init__(
            SigmoidTopKRouter(m.num_experts, c.hidden_size, m.num_experts_per_tok),
            Experts(m.num_experts, first, count, c.hidden_size, m.intermediate_size),
        )
        self.register_buffer("e_score_correction_bias", torch.empty(m.num_experts))

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        topk_ids_TK, topk_weights_TK = self.gate(x_TD, self.e_score_correction_bias)
        return x_TD, topk_ids_TK, topk_weights_TK


def decoder_layer(c: ModelConfig, expert_range: tuple[int, int] | None) -> DecoderLayer:
    """Attention, then the expert block under the checkpoint's name for it."""
    attention = GQAttention(c, whole_qk_norm=True)
    return DecoderLayer(*attention_then_mlp(c, attention, MiniMaxM2MoE(c, expert_range), mlp_name="block_sparse_moe"))


class MiniMaxM2ForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(c, [decoder_layer(c, expert_range) for _ in range(c.num_layers)])
