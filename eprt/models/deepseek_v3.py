"""DeepSeek-V3 and Kimi-K2: MLA with interleaved RoPE; sigmoid noaux_tc experts plus shared experts;
the first `first_k_dense_replace` layers dense."""

from __future__ import annotations

from torch import nn

from eprt.config import ModelConfig
from eprt.models.decoder import CausalLM, DecoderLayer
from eprt.models.layers import GatedMLP
from eprt.models.mla import MLAttention
from eprt.models.moe import Experts, MoE
from eprt.models.router import SigmoidGroupRouter
from eprt.parallel.placement import ExpertPlacement


def deepseek_mlp(c: ModelConfig, i: int, expert_range: tuple[int, int] | None) -> nn.Module:
    """Layer i's MLP: a gated MLP in the first dense layers, else the sigmoid-routed experts
    (this process holding `expert_range`) plus the shared experts."""
    if not c.is_moe(i):
        return GatedMLP(c.hidden_size, c.intermediate_size)
    first, count = expert_range or ExpertPlacement(c.num_experts).range
    I = c.moe_intermediate_size
    gate = SigmoidGroupRouter(c.num_experts, c.hidden_size, c.num_experts_per_tok, c.n_group,
                              c.topk_group, c.norm_topk_prob, c.routed_scaling_factor)
    shared = GatedMLP(c.hidden_size, I * c.num_shared_experts) if c.num_shared_experts else None
    return MoE(gate, Experts(c.num_experts, first, count, c.hidden_size, I), shared)

class DeepseekV3ForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(c, [DecoderLayer(c, MLAttention(c), deepseek_mlp(c, i, expert_range))
                             for i in range(c.num_layers)])
