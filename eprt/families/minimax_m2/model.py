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
from eprt.models.decoder import CausalLM, DecoderLayer
from eprt.models.layers import RMSNorm, linear
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


class MiniMaxM2DecoderLayer(DecoderLayer):
    """A pre-norm layer whose MLP is the expert block, under the checkpoint's name for it."""

    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = GQAttention(c, whole_qk_norm=True)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.block_sparse_moe = MiniMaxM2MoE(c, expert_range)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        carry, m = self.attend(x, cos, sin)
        return carry + self.block_sparse_moe(m)

    def ffn(self) -> nn.Module:
        return self.block_sparse_moe


class MiniMaxM2ForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(c, [MiniMaxM2DecoderLayer(c, expert_range) for _ in range(c.num_layers)])
