"""Mistral-Small-4: DeepSeek-V3's decoder (MLA with interleaved RoPE under YaRN, shared experts,
the first layers dense) with Llama-4's query temperature in attention and DeepSeek-V2's softmax
router with expert groups and no correction bias."""

from __future__ import annotations

from torch import nn

from eprt.config import ModelConfig
from eprt.models.decoder import CausalLM, DecoderLayer, attention_then_mlp
from eprt.models.layers import GatedMLP
from eprt.models.mla import MLAttention
from eprt.models.moe import Experts, MoE, held_experts
from eprt.models.router import SoftmaxGroupRouter
from eprt.models.vlm import LanguageModelOf


def mistral4_mlp(c: ModelConfig, i: int, expert_range: tuple[int, int] | None) -> nn.Module:
    """Layer i's MLP: a gated MLP in the first dense layers, else the softmax-routed experts (this
    process holding `expert_range`) plus the shared experts."""
    if not c.is_moe(i):
        return GatedMLP(c.hidden_size, c.intermediate_size)
    m, D = c.moe, c.hidden_size
    first, count = held_experts(expert_range, m.num_experts)
    gate = SoftmaxGroupRouter(
        m.num_experts, D, m.num_experts_per_tok, m.n_group, m.topk_group, m.norm_topk_prob, m.routed_scaling_factor
    )
    shared = GatedMLP(D, m.intermediate_size * m.num_shared_experts)
    return MoE(gate, Experts(m.num_experts, first, count, D, m.intermediate_size), shared)


def decoder_layers(c: ModelConfig, expert_range: tuple[int, int] | None) -> list[DecoderLayer]:
    temperature = (c.own.temperature_beta, c.own.temperature_positions)
    return [
        DecoderLayer(
            *attention_then_mlp(c, MLAttention(c, query_temperature=temperature), mistral4_mlp(c, i, expert_range))
        )
        for i in range(c.num_layers)
    ]


class Mistral4ForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(c, decoder_layers(c, expert_range))


class Mistral4ForConditionalGeneration(LanguageModelOf):
    """The release: the causal LM under `language_model.`; the vision tower and the projector are
    not modeled (their tensors travel through convert and export untouched)."""

    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(Mistral4ForCausalLM(c, expert_range))
