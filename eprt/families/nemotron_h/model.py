"""Nemotron-H / Nemotron-3 and the language model of Nemotron-H-Omni: layers of one block each, a norm
and one mixer (eprt.families.nemotron_h.config): Mamba-2, GQA attention without positional
encoding, a relu² MLP, or a MoE of relu² experts under a sigmoid group router beside one shared
expert, routed in a latent on Super and Ultra."""

from __future__ import annotations

from torch import nn

from eprt.config import ModelConfig
from eprt.families.nemotron_h.config import ATTENTION, MAMBA, MLP, NemotronHConfig
from eprt.families.nemotron_h.layout import DECODER, RELU2_EXPERTS
from eprt.models.attention import GQAttention
from eprt.models.decoder import Block, CausalLM, DecoderLayer
from eprt.models.layers import RMSNorm, UngatedMLP
from eprt.models.mamba2 import Mamba2Mixer
from eprt.models.moe import Experts, LatentMoE, MoE, held_experts
from eprt.models.router import SigmoidGroupRouter
from eprt.models.vlm import LanguageModelOf


def mamba2(c: ModelConfig) -> Mamba2Mixer:
    m = c.own.mamba
    return Mamba2Mixer(
        c.hidden_size,
        m.heads,
        m.head_dim,
        m.state_size,
        m.groups,
        m.conv_kernel,
        m.conv_bias,
        (m.dt_min, float("inf") if m.dt_max is None else m.dt_max),
        m.chunk_size,
        c.rms_norm_eps,
    )


def sparse_moe(c: ModelConfig, expert_range: tuple[int, int] | None) -> MoE:
    own: NemotronHConfig = c.own
    m, D = c.moe, c.hidden_size
    first, count = held_experts(expert_range, m.num_experts)
    gate = SigmoidGroupRouter(
        m.num_experts, D, m.num_experts_per_tok, m.n_group, m.topk_group, m.norm_topk_prob, m.routed_scaling_factor
    )
    experts = Experts(m.num_experts, first, count, c.routed_width, m.intermediate_size, pieces=RELU2_EXPERTS)
    shared = UngatedMLP(D, own.shared_intermediate_size)
    if own.latent_size is None:
        return MoE(gate, experts, shared)
    return LatentMoE(gate, experts, shared, D, own.latent_size, None, ("fc1_latent_proj", "fc2_latent_proj"))


def mixer(c: ModelConfig, kind: str, expert_range: tuple[int, int] | None) -> nn.Module:
    if kind == MAMBA:
        return mamba2(c)
    if kind == ATTENTION:
        return GQAttention(c)
    if kind == MLP:
        return UngatedMLP(c.hidden_size, c.intermediate_size)
    return sparse_moe(c, expert_range)


def nemotron_layer(c: ModelConfig, i: int, expert_range: tuple[int, int] | None) -> DecoderLayer:
    kind = c.own.layer_kinds[i]
    return DecoderLayer((Block("norm", "mixer"), RMSNorm(c.hidden_size, c.rms_norm_eps), mixer(c, kind, expert_range)))


class NemotronHForCausalLM(CausalLM):
    decoder_name = DECODER  # the release's `backbone`

    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(c, [nemotron_layer(c, i, expert_range) for i in range(c.num_layers)])


class NemotronHOmni(LanguageModelOf):
    """The Omni VLM's language model, under `language_model.`."""

    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(NemotronHForCausalLM(c, expert_range))
