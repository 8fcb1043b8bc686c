"""GPT-OSS, from the shared blocks: GQA with biases and sinks, over a sliding window on the sliding
layers; then a MoE whose router (with a bias) picks the top k logits and weighs them by their
softmax, over experts with biases and the clamped SwiGLU (eprt.families.gpt_oss.config)."""

from __future__ import annotations

import torch
from torch import nn

from eprt.config import ModelConfig
from eprt.families.gpt_oss.layout import pieces
from eprt.models.attention import GQAttention
from eprt.models.decoder import CausalLM, DecoderLayer, attention_then_mlp
from eprt.models.layers import linear
from eprt.models.moe import Experts, LocalDispatcher, MoE, held_experts
from eprt.models.router import top_k


class TopKSoftmaxRouter(nn.Module):
    """logits = x W^T + b in the model dtype; the top k of them (ties to the lower expert), weighed
    by the softmax over those k alone, rounded to the model dtype as the reference rounds them."""

    def __init__(self, num_experts: int, hidden: int, k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.bias = nn.Parameter(torch.empty(num_experts))
        self.k = k

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits_TE = linear(x_TD, self.weight, self.bias)
        ids_TK = top_k(logits_TE, self.k)
        w_TK = torch.softmax(logits_TE.gather(1, ids_TK).float(), dim=-1)
        return ids_TK, w_TK.to(x_TD.dtype).float()


class GptOssMoE(MoE):
    """The routed experts behind `router`, as the checkpoint names it (`gate` is what the
    quantization passes read of every MoE block); no shared expert."""

    def __init__(self, router: TopKSoftmaxRouter, experts: Experts):
        nn.Module.__init__(self)
        self.router, self.experts, self.shared_experts = router, experts, None
        self.dispatcher = LocalDispatcher()

    @property
    def gate(self) -> TopKSoftmaxRouter:
        return self.router


class GptOssForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        m, own = c.moe, c.own
        first, count = held_experts(expert_range, m.num_experts)

        def layer(i: int) -> DecoderLayer:
            window = own.sliding_window if i in own.sliding_layers else None
            attention = GQAttention(c, sinks=True, window=window)
            moe = GptOssMoE(
                TopKSoftmaxRouter(m.num_experts, c.hidden_size, m.num_experts_per_tok),
                Experts(m.num_experts, first, count, c.hidden_size, m.intermediate_size, pieces=pieces(c)),
            )
            return DecoderLayer(*attention_then_mlp(c, attention, moe))

        super().__init__(c, [layer(i) for i in range(c.num_layers)])
