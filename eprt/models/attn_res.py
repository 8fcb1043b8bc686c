"""Attention residuals (Kimi-K3): each sublayer reads a learned softmax mixture over depth instead
of the plain residual sum.

The stream is cut into blocks of `attn_res_block_size` layers. `blocks` holds a snapshot per
block begun so far: the input of layers 0, bs, 2bs, ... The value a layer carries on is the
partial sum of the outputs since its block began. Before attention, before the MLP and before
the final norm, the candidates [*blocks, partial] are mixed with weights

    softmax_j < rmsnorm(c_j), res_norm.w * res_proj.w >        (per token, in fp32)

and the sublayer reads sum_j p_j c_j of the raw candidates.
"""

from __future__ import annotations

import torch

from eprt.models.layers import Linear, RMSNorm


def attn_res_mix(blocks: list[torch.Tensor], partial: torch.Tensor, norm: RMSNorm, proj: Linear) -> torch.Tensor:
    """The mixture of the block snapshots and the partial sum that one query (norm, proj) reads;
    the partial sum itself while no block has begun."""
    if not blocks:
        return partial
    c = torch.stack([*blocks, partial]).float()  # [J, B, T, D]
    query = norm.weight.float() * proj.weight.float().reshape(-1)
    logits = (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + norm.eps)) @ query
    p = torch.softmax(logits, dim=0)
    return (p[..., None] * c).sum(0).to(partial.dtype)
