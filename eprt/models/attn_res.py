"""Attention residuals (Kimi-K3): each block reads a learned softmax mixture over depth instead of
the plain residual sum.

The stream is cut into spans of `attn_res_block_size` layers. The snapshots (`LayerContext.snapshots`)
hold one per span begun so far: the input of layers 0, bs, 2bs, ... The value a layer carries on is
the partial sum of the outputs since its span began. Before each block of a layer and before the
final norm, the candidates [*snapshots, partial] are mixed with weights

    softmax_j < rmsnorm(c_j), res_norm.w * res_proj.w >        (per token, in fp32)

and the block's norm reads sum_j p_j c_j of the raw candidates.
"""

from __future__ import annotations

import torch
from torch import nn

from eprt.models.decoder import Block, DecoderLayer, LayerContext
from eprt.models.layers import Linear, RMSNorm


def attn_res_mix(snapshots: list[torch.Tensor], partial: torch.Tensor, norm: RMSNorm, proj: Linear) -> torch.Tensor:
    """The mixture of the snapshots and the partial sum that one query (norm, proj) reads; the
    partial sum itself while no span has begun."""
    if not snapshots:
        return partial
    c = torch.stack([*snapshots, partial]).float()  # [J, B, T, D]
    query = norm.weight.float() * proj.weight.float().reshape(-1)
    logits = (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + norm.eps)) @ query
    p = torch.softmax(logits, dim=0)
    return (p[..., None] * c).sum(0).to(partial.dtype)


class AttentionResidualLayer(DecoderLayer):
    """A decoder layer under attention residuals: block k reads the mixture through its query
    `{queries[k]}_norm`, `{queries[k]}_proj`. A span's first layer (`starts_block`) files its input
    as a snapshot once its first block's mixer has run, and starts a new partial sum from that
    mixer's output."""

    def __init__(
        self,
        *blocks: tuple[Block, nn.Module, nn.Module],
        queries: tuple[str, ...],
        starts_block: bool,
        width: int,
        eps: float,
    ):
        super().__init__(*blocks)
        assert len(queries) == len(self.blocks), (queries, self.blocks)
        for q in queries:
            self.add_module(f"{q}_norm", RMSNorm(width, eps))
            self.add_module(f"{q}_proj", Linear(width, 1))
        self.queries, self.starts_block = queries, starts_block

    def enter(self, k: int, x: torch.Tensor, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.queries[k]
        return x, attn_res_mix(ctx.snapshots, x, getattr(self, f"{q}_norm"), getattr(self, f"{q}_proj"))

    def leave(self, k: int, carry: torch.Tensor, y: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        if k == 0 and self.starts_block:  # the span's snapshot (`snapshots`), and a new partial sum
            ctx.snapshots.append(carry)
            return y
        return carry + y

    def snapshots(self, x: torch.Tensor) -> list[torch.Tensor]:
        return [x] if self.starts_block else []
