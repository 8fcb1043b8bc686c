"""Qwen3-MoE: GQA with q/k norm and rotate-half RoPE; softmax top-k experts, no shared experts."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.models.attention import GQAttention
from eprt.models.decoder import CausalLM, DecoderLayer, attention_then_mlp
from eprt.models.layers import GatedMLP
from eprt.models.moe import Experts, MoE, held_experts
from eprt.models.router import SoftmaxRouter


class Qwen3MoeForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        first, count = held_experts(expert_range, c.num_experts)

        def mlp(i: int):
            if not c.is_moe(i):
                return GatedMLP(c.hidden_size, c.intermediate_size)
            m = c.moe
            return MoE(
                SoftmaxRouter(m.num_experts, c.hidden_size, m.num_experts_per_tok, m.norm_topk_prob),
                Experts(m.num_experts, first, count, c.hidden_size, m.intermediate_size),
            )

        super().__init__(c, [DecoderLayer(*attention_then_mlp(c, GQAttention(c), mlp(i))) for i in range(c.num_layers)])
