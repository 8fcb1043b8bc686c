"""MiniMax-M3's language model, alone (`minimax_m3_vl_text`) or inside the vision-language checkpoint
(`minimax_m3_vl`, under `language_model.`).

Every layer: grouped-query attention with a per-head q/k norm and partial rotate-half RoPE, then a
dense MLP or a MoE (a sigmoid router with a correction bias choosing the top k, their weights
renormalized and scaled by routed_scaling_factor, plus one shared expert). Every MLP's activation is
the clamped SwiGLU (eprt.models.layers.ClampedSwiGLU); every RMSNorm scales by (1 + weight). On the
sparse layers a block-sparse indexer chooses, per query and per group of heads, the blocks of keys
the attention may see.
"""

from __future__ import annotations

import torch
from torch import nn

from eprt.config import ModelConfig
from eprt.families.minimax_m3_vl.layout import indexer_names, moe_name
from eprt.models.attention import GQAttention
from eprt.models.decoder import CausalLM, Decoder, DecoderLayer, attention_then_mlp
from eprt.models.layers import ClampedSwiGLU, FusedGatedMLP, GatedMLP, Linear, ZeroCenteredRMSNorm
from eprt.models.moe import Experts, MoE, held_experts
from eprt.models.rope import rope_rotate_half
from eprt.models.router import SigmoidGroupRouter, top_k
from eprt.models.vlm import LanguageModelOf


class BlockSparseIndexer(nn.Module):
    """Per query t and earlier key s, in each of n heads of d:
        score_h(t, s) = q_norm(q_proj x_t)_h . k_norm(k_proj x_s), both RoPE'd as the attention is,
    in fp32. A key block's score is the best of its keys'; query t keeps the `topk_blocks` best
    blocks of each head (fewer where fewer blocks hold an earlier key), the `local_blocks` blocks
    ending at its own always among them. Head h of the n picks the blocks of the H/n attention
    heads h*H/n .. (h+1)*H/n - 1. Among equal block scores the lower block wins (eprt.models.router.top_k)."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        ix, D = c.own.indexer, c.hidden_size
        self.n_heads, self.head_dim = ix.n_heads, ix.head_dim
        self.block, self.topk, self.local = ix.block_size, ix.topk_blocks, ix.local_blocks
        self.q_proj = Linear(D, ix.n_heads * ix.head_dim)
        self.k_proj = Linear(D, ix.head_dim)
        self.q_norm = ZeroCenteredRMSNorm(ix.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(ix.head_dim, c.rms_norm_eps)

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """keep [B, n, T, T]: True where query t of the heads of index head g may see key s (before
        the causal mask; eprt.models.attention.causal_attention applies it per group of heads)."""
        B, T, _ = x_BTD.shape
        n, d, L = self.n_heads, self.head_dim, self.block
        q_BnTd = self.q_norm(self.q_proj(x_BTD).view(B, T, n, d)).transpose(1, 2)
        k_BTd = self.k_norm(self.k_proj(x_BTD))
        q_BnTd, k_BTd = rope_rotate_half(q_BnTd, cos, sin), rope_rotate_half(k_BTd, cos, sin)
        scores_BnTS = q_BnTd.float() @ k_BTd.float().transpose(-1, -2)[:, None]
        causal = torch.ones(T, T, dtype=torch.bool, device=x_BTD.device).tril()
        scores_BnTS = scores_BnTS.masked_fill(~causal, float("-inf"))
        nb = -(-T // L)
        padded = torch.nn.functional.pad(scores_BnTS, (0, nb * L - T), value=float("-inf"))
        blocks_BnTN = padded.view(B, n, T, nb, L).amax(-1)
        own_block = torch.arange(T, device=x_BTD.device) // L
        local_TL = (own_block[:, None] - torch.arange(self.local, device=x_BTD.device)).clamp(min=0)
        blocks_BnTN.scatter_(-1, local_TL.expand(B, n, T, self.local), float("inf"))
        k = min(self.topk, nb)
        picked = top_k(blocks_BnTN.reshape(-1, nb), k)
        # a pick with no earlier key in it (score -inf: there were fewer blocks than k) keeps nothing
        real = blocks_BnTN.reshape(-1, nb).gather(1, picked) > float("-inf")
        keep_blocks = torch.zeros(B * n * T, nb + 1, dtype=torch.bool, device=x_BTD.device)
        keep_blocks.scatter_(1, picked.masked_fill(~real, nb), True)
        return keep_blocks[:, :nb].view(B, n, T, nb).repeat_interleave(L, dim=-1)[..., :T]


class MiniMaxM3Attention(GQAttention):
    """GQA with (1 + weight) q/k norms; on a sparse layer, the indexer's choice of key blocks.
    The release names the indexer's pieces `index_q_proj`, ... on the attention, transformers
    `indexer.q_proj`, ...: the indexer holds the modules registered under either name."""

    def __init__(self, c: ModelConfig, sparse: bool):
        super().__init__(c, norm=ZeroCenteredRMSNorm)
        indexer = BlockSparseIndexer(c) if sparse else None
        if indexer is not None and c.own.transformers_names:
            self.indexer = indexer
        elif indexer is not None:
            for piece, name in indexer_names(c).items():
                self.add_module(name, getattr(indexer, piece))
        # held unregistered: its pieces are registered above, under the checkpoint's names
        self.__dict__["block_indexer"] = indexer

    def input_readers(self) -> tuple[nn.Module, ...]:
        ix = self.block_indexer
        return (*super().input_readers(), *(() if ix is None else (ix.q_proj, ix.k_proj)))

    def keep(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        return None if self.block_indexer is None else self.block_indexer(x_BTD, cos, sin)


class BlockBiasRouter(SigmoidGroupRouter):
    """The router reading its correction bias from the MoE block that holds it (`block_sparse_moe.
    e_score_correction_bias` in the release, where transformers has `mlp.gate.e_score_correction_bias`)."""

    def __init__(self, router: SigmoidGroupRouter, block: MoE):
        nn.Module.__init__(self)
        self.weight = router.weight
        self.k, self.n_group, self.topk_group = router.k, router.n_group, router.topk_group
        self.renormalize, self.scaling = router.renormalize, router.scaling
        self.__dict__["block"] = block  # not a submodule: the block owns the router

    @property
    def e_score_correction_bias(self) -> torch.Tensor:
        return self.block.e_score_correction_bias


class BiasOnBlockMoE(MoE):
    def __init__(self, gate: SigmoidGroupRouter, experts: Experts, shared_experts: nn.Module):
        super().__init__(gate, experts, shared_experts)
        self.register_buffer("e_score_correction_bias", gate.e_score_correction_bias)
        self.gate = BlockBiasRouter(gate, self)


def mlp(c: ModelConfig, i: int, expert_range: tuple[int, int] | None) -> nn.Module:
    own, D = c.own, c.hidden_size
    act = ClampedSwiGLU(own.swiglu_alpha, own.swiglu_limit)
    dense = FusedGatedMLP if own.transformers_names else GatedMLP
    if not c.is_moe(i):
        return dense(D, c.intermediate_size, act)
    m = c.moe
    first, count = held_experts(expert_range, m.num_experts)
    return (MoE if own.transformers_names else BiasOnBlockMoE)(
        SigmoidGroupRouter(m.num_experts, D, m.num_experts_per_tok, 1, 1, m.norm_topk_prob, m.routed_scaling_factor),
        Experts(m.num_experts, first, count, D, m.intermediate_size, act),
        dense(D, own.shared_intermediate_size, act),
    )


def decoder_layers(c: ModelConfig, expert_range: tuple[int, int] | None) -> list[DecoderLayer]:
    """Attention, then the MLP, every norm (1 + weight); the release names a routed layer's MLP
    block_sparse_moe and a dense one mlp."""
    return [
        DecoderLayer(
            *attention_then_mlp(
                c,
                MiniMaxM3Attention(c, i in c.own.sparse_layers),
                mlp(c, i, expert_range),
                mlp_name=moe_name(c) if c.is_moe(i) else "mlp",
                norm=ZeroCenteredRMSNorm,
            )
        )
        for i in range(c.num_layers)
    ]


class MiniMaxM3Decoder(Decoder):
    """The shared decoder with a (1 + weight) final norm."""

    def __init__(self, c: ModelConfig, layers: list[DecoderLayer]):
        super().__init__(c, layers)
        self.norm = ZeroCenteredRMSNorm(c.hidden_size, c.rms_norm_eps)


class MiniMaxM3ForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(c, decoder_layers(c, expert_range), decoder=MiniMaxM3Decoder)


class MiniMaxM3ForConditionalGeneration(LanguageModelOf):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(MiniMaxM3ForCausalLM(c, expert_range))
