"""Gated DeltaNet (Qwen3-Next, Qwen3.5): the gated delta rule with one decay per head.

Per value head, with q and k L2-normalized (q also scaled by Dk^-0.5), log-decay g_t <= 0,
beta_t in (0, 1) and a state S in R^{Dk x Dv} starting at 0:

    S_t = exp(g_t) S_{t-1} + beta_t k_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = S_t^T q_t

It is KDA's recurrence with the same decay on every key channel, so `gated_delta_chunked` runs
`kda_chunked` with g broadcast over the channels; `gated_delta_recurrent` is the loop above,
token by token, the reference. Each key head serves value_heads / key_heads value heads. On
CUDA, when flash-linear-attention is installed, `gated_delta_rule` runs its
`chunk_gated_delta_rule` kernel instead.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from eprt.models.kda import ShortConv, chunk_size, kda_chunked, l2norm
from eprt.models.layers import Linear, RMSNorm


def gated_delta_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """The recurrence, one token at a time, in fp32. q, k [B, T, H, Dk]; v [B, T, H, Dv];
    g, beta [B, T, H] (as many heads as v). Returns o [B, T, H, Dv] in v's dtype."""
    B, T, H, Dk = k.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    o = q.new_empty(B, T, H, v.shape[-1])
    for t in range(T):
        S = S * g[:, t, :, None, None].exp()
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o.to(v.dtype)


def gated_delta_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """The same in chunks (`kda_chunked`); shapes as the recurrence. Each sequence's chunk size is
    chosen from its own decay, so that its output does not depend on the sequences batched with
    it (calibration at any expert-parallel layout must see the same activations)."""
    g = g[..., None].expand_as(k)
    if chunk:
        return kda_chunked(q, k, v, g, beta, chunk)
    sizes = torch.tensor([chunk_size(g[b : b + 1]) for b in range(k.shape[0])])
    o = v.new_empty(v.shape)
    for C in sizes.unique().tolist():
        rows = (sizes == C).nonzero().flatten()
        o[rows] = kda_chunked(q[rows], k[rows], v[rows], g[rows], beta[rows], C)
    return o


@functools.cache
def fla_chunk_gated_delta_rule():
    """flash-linear-attention's chunk kernel, or None where it is not installed (it needs triton)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


def gated_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """Over whole sequences from a zero state, q and k [B, T, Hk, Dk] as the short convolution gives
    them, v [B, T, Hv, Dv], g and beta [B, T, Hv]: fla's kernel on CUDA when installed (it
    normalizes q and k itself), else `gated_delta_chunked`."""
    groups = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    scale = q.shape[-1] ** -0.5
    kernel = fla_chunk_gated_delta_rule() if q.is_cuda else None
    if kernel is None:
        return gated_delta_chunked(l2norm(q) * scale, l2norm(k), v, g, beta)
    o, _ = kernel(q, k, v, g.float(), beta.to(v.dtype), scale=scale, use_qk_l2norm_in_kernel=True)
    return o.to(v.dtype)


class GatedDeltaNet(nn.Module):
    """The linear-attention layer: q, k, v through one causal short convolution (SiLU); decay
    exp(-exp(A_log) * softplus(a + dt_bias)) and beta = sigmoid(b) per value head; the output
    RMS-normalized per head, times silu(z), projected out.

    The input projections come fused per key head (Qwen3-Next: in_proj_qkvz holds each key
    head's [q, k, its value heads' v, their z], in_proj_ba its heads' [b, a]) or apart (Qwen3.5:
    in_proj_qkv = [all q | all k | all v], in_proj_z, in_proj_b, in_proj_a)."""

    def __init__(
        self,
        hidden: int,
        key_heads: int,
        value_heads: int,
        key_head_dim: int,
        value_head_dim: int,
        conv_kernel: int,
        split_projections: bool,
        eps: float,
    ):
        super().__init__()
        self.key_heads, self.value_heads = key_heads, value_heads
        self.key_head_dim, self.value_head_dim = key_head_dim, value_head_dim
        self.split_projections = split_projections
        K, V = key_heads * key_head_dim, value_heads * value_head_dim
        if split_projections:
            self.in_proj_qkv, self.in_proj_z = Linear(hidden, 2 * K + V), Linear(hidden, V)
            self.in_proj_b, self.in_proj_a = Linear(hidden, value_heads), Linear(hidden, value_heads)
        else:
            self.in_proj_qkvz = Linear(hidden, 2 * K + 2 * V)
            self.in_proj_ba = Linear(hidden, 2 * value_heads)
        self.conv1d = ShortConv(2 * K + V, conv_kernel)
        self.dt_bias = nn.Parameter(torch.empty(value_heads))
        self.A_log = nn.Parameter(torch.empty(value_heads))
        self.norm = RMSNorm(value_head_dim, eps)
        self.out_proj = Linear(V, hidden)

    def project(self, x_BTD: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(q, k, v side by side [B, T, 2K + V], z [B, T, Hv, Dv], b [B, T, Hv], a [B, T, Hv])."""
        if self.split_projections:
            z = self.in_proj_z(x_BTD).unflatten(-1, (self.value_heads, self.value_head_dim))
            return self.in_proj_qkv(x_BTD), z, self.in_proj_b(x_BTD), self.in_proj_a(x_BTD)
        # (flatten, not reshape with -1: an empty batch, a rank with no sequence, has nothing to infer from)
        Dk, Dv, r = self.key_head_dim, self.value_head_dim, self.value_heads // self.key_heads
        per_head = self.in_proj_qkvz(x_BTD).unflatten(-1, (self.key_heads, -1))
        q, k, v, z = per_head.split([Dk, Dk, r * Dv, r * Dv], dim=-1)
        b, a = self.in_proj_ba(x_BTD).unflatten(-1, (self.key_heads, 2 * r)).split([r, r], dim=-1)
        qkv = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
        return qkv, z.flatten(-2).unflatten(-1, (self.value_heads, Dv)), b.flatten(-2), a.flatten(-2)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        qkv, z, b, a = self.project(x_BTD)
        K = self.key_heads * self.key_head_dim
        q, k, v = self.conv1d(qkv).split([K, K, self.value_heads * self.value_head_dim], dim=-1)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        o = gated_delta_rule(
            q.unflatten(-1, (self.key_heads, -1)),
            k.unflatten(-1, (self.key_heads, -1)),
            v.unflatten(-1, (self.value_heads, -1)),
            g,
            torch.sigmoid(b),
        )
        # the reference: normalize and scale in the model dtype, then the gate in fp32, cast back once
        o = (self.norm(o) * F.silu(z.float())).to(o.dtype)
        return self.out_proj(o.flatten(-2))
