"""DeepSeek-V3 and Kimi-K2: MLA with interleaved RoPE; sigmoid noaux_tc experts plus shared experts;
the first `first_k_dense_replace` layers dense."""

from __future__ import annotations

import torch
from torch import nn

from eprt.config import ModelConfig
from eprt.models.attention import GQAttention
from eprt.models.decoder import CausalLM, DecoderLayer, Embedding, attention_then_mlp
from eprt.models.layers import GatedMLP, Linear, RMSNorm
from eprt.models.mla import MLAttention
from eprt.models.moe import Experts, MoE, held_experts
from eprt.models.router import SigmoidGroupRouter


def deepseek_mlp(c: ModelConfig, i: int, expert_range: tuple[int, int] | None) -> nn.Module:
    """Layer i's MLP: a gated MLP in the first dense layers, else the sigmoid-routed experts
    (this process holding `expert_range`) plus the shared experts."""
    if not c.is_moe(i):
        return GatedMLP(c.hidden_size, c.intermediate_size)
    m = c.moe
    first, count = held_experts(expert_range, m.num_experts)
    I = m.intermediate_size
    gate = SigmoidGroupRouter(
        m.num_experts,
        c.hidden_size,
        m.num_experts_per_tok,
        m.n_group,
        m.topk_group,
        m.norm_topk_prob,
        m.routed_scaling_factor,
    )
    shared = GatedMLP(c.hidden_size, I * m.num_shared_experts) if m.num_shared_experts else None
    return MoE(gate, Experts(m.num_experts, first, count, c.hidden_size, I), shared)


class DeepseekV3ForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(
            c,
            [
                DecoderLayer(*attention_then_mlp(c, MLAttention(c), deepseek_mlp(c, i, expert_range)))
                for i in range(c.num_layers)
            ],
        )


class SharedHead(nn.Module):
    def __init__(self, c: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.head = Linear(c.hidden_size, c.vocab_size)


class DeepseekV3MTP(DecoderLayer):
    """One multi-token-prediction layer (`model.layers.{num_hidden_layers + k}`): its own embedding
    table, two norms and `eh_proj` in front of a full decoder layer (the model's attention: MLA,
    or GLM-4.5's GQA; the MoE of the last decoder layer's kind), and a shared head behind it. Its
    tensors sit beside the decoder layer's, under the same prefix, as the released checkpoints
    store them."""

    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        # the MTP layer is MoE whenever the model has MoE layers (DeepSeek-V3's last layer is)
        mlp_layer = c.moe_layers[-1] if c.moe_layers else 0
        attention = MLAttention(c) if c.mla else GQAttention(c)
        super().__init__(*attention_then_mlp(c, attention, deepseek_mlp(c, mlp_layer, expert_range)))
        D = c.hidden_size
        self.embed_tokens = Embedding(c.vocab_size, D)
        self.enorm = RMSNorm(D, c.rms_norm_eps)
        self.hnorm = RMSNorm(D, c.rms_norm_eps)
        self.eh_proj = Linear(2 * D, D)
        self.shared_head = SharedHead(c)

    def mtp_input(self, input_ids: torch.Tensor, hidden: torch.Tensor, shift: int = 1) -> torch.Tensor:
        """The decoder layer's input for sequences `input_ids` [B, T] whose last decoder layer (or
        previous MTP layer) gave `hidden` [B, T, D] (before the final norm): at position t,
        eh_proj(cat(enorm(embed(token[t + shift])), hnorm(hidden[t]))), the embedding first, as vLLM's
        deepseek_mtp.py and DeepSeek's own inference code concatenate (MTP layer k predicts with
        shift k + 1). The last positions have no such token in a calibration sample: their
        embedding is zero, as vLLM zeroes one it has none for."""
        emb = tokens_ahead(self.embed_tokens, input_ids, shift)
        return self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))


def tokens_ahead(embed: nn.Module, input_ids: torch.Tensor, shift: int) -> torch.Tensor:
    """[B, T, D]: at position t the embedding of token t + shift of `input_ids` [B, T], zero past
    the end of the sample (as vLLM zeroes an MTP input it has no token for)."""
    emb = embed(input_ids[:, shift:])
    return torch.cat([emb, emb.new_zeros(emb.shape[0], input_ids.shape[1] - emb.shape[1], emb.shape[2])], dim=1)
