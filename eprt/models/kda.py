"""Kimi Delta Attention (KDA): a gated delta rule with a decay per key channel (Kimi-Linear, Kimi-K3).

Per head, with q and k L2-normalized (q also scaled by Dk^-0.5), log-decay g_t in R^Dk (<= 0),
beta_t in (0, 1) and a state S in R^{Dk x Dv} starting at 0:

    S'  = diag(exp g_t) S_{t-1}
    S_t = S' + beta_t k_t (v_t - S'^T k_t)^T
    o_t = S_t^T q_t

`kda_recurrent` is that loop, token by token: the reference. `kda_chunked` computes the same in
chunks of up to 64 tokens, the work inside chunks as batched matmuls and one Python step per
chunk; on CUDA, when flash-linear-attention is installed, `kda` runs its `chunk_kda` kernel instead.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from eprt.models.layers import Linear, RMSNorm

L2NORM_EPS = 1e-6


def kda_recurrent(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor
) -> torch.Tensor:
    """The recurrence, one token at a time, in fp32. q, k, g [B, T, H, Dk]; v [B, T, H, Dv];
    beta [B, T, H]. Returns o [B, T, H, Dv] in v's dtype."""
    B, T, H, Dk = k.shape
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    S = q.new_zeros(B, H, Dk, v.shape[-1])
    o = q.new_empty(B, T, H, v.shape[-1])
    for t in range(T):
        S = S * g[:, t, :, :, None].exp()
        delta = (v[:, t] - torch.einsum("bhkv,bhk->bhv", S, k[:, t])) * beta[:, t, :, None]
        S = S + k[:, t, :, :, None] * delta[:, :, None, :]
        o[:, t] = torch.einsum("bhkv,bhk->bhv", S, q[:, t])
    return o.to(v.dtype)


def kda_chunked(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """The same recurrence in chunks of C tokens, in fp32; shapes as `kda_recurrent`.

    Inside a chunk, with G_t the cumulative log-decay from the chunk's start and S_0 the state
    before it, the values each token writes, u_t = beta_t (v_t - S'_t^T k_t), solve the unit
    lower-triangular system

        u_t + beta_t sum_{j<t} A_tj u_j = beta_t (v_t - (exp(G_t) * k_t)^T S_0),
        A_tj = (exp(G_t) * k_t) . (exp(-G_j) * k_j),

    so u = U - W S_0, with U and W from one triangular inverse per chunk, all chunks at once. Then
        o_t = (exp(G_t) * q_t)^T S_0 + sum_{j<=t} ((exp(G_t) * q_t) . (exp(-G_j) * k_j)) u_j,
        S_C = diag(exp G_C) S_0 + sum_j (exp(G_C - G_j) * k_j) u_j^T,
    and only these three products run chunk after chunk. exp(-G_j) grows with the decay inside
    a chunk, so C is the largest power of two up to 64 whose chunks decay by at most e^-80
    (`chunk_size`): the factors stay inside fp32's range. Padding the last chunk with beta = 0
    and k = 0 leaves the real tokens as they are.
    """
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    dtype = v.dtype
    C = chunk or chunk_size(g)
    N = -(-T // C)
    pad = N * C - T
    # [N, B, H, C, D]: every product below is a batched matmul, and chunk n is one contiguous
    # slice (explicit sizes: an empty batch has no -1 to infer)
    q, k, v, g = (
        F.pad(x.float(), (0, 0, 0, 0, 0, pad)).reshape(B, N, C, H, x.shape[-1]).permute(1, 0, 3, 2, 4).contiguous()
        for x in (q, k, v, g)
    )
    beta = F.pad(beta.float(), (0, 0, 0, pad)).reshape(B, N, C, H, 1).permute(1, 0, 3, 2, 4)
    G = g.cumsum(dim=-2)
    k_out, k_in, q_out = k * G.exp(), k * (-G).exp(), q * G.exp()
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    A = (k_out @ k_in.transpose(-1, -2)).masked_fill(~causal.tril(-1), 0.0)
    qk = (q_out @ k_in.transpose(-1, -2)).masked_fill(~causal, 0.0)
    eye = torch.eye(C, device=q.device)
    inv = torch.linalg.solve_triangular(eye + beta * A, eye.expand_as(A), upper=False, unitriangular=True)
    U, W = inv @ (beta * v), inv @ (beta * k_out)
    G_end = G[..., -1:, :]
    k_end = (k * (G_end - G).exp()).transpose(-1, -2).contiguous()  # [N, B, H, Dk, C]
    decay_end = G_end.transpose(-1, -2).exp()  # [N, B, H, Dk, 1]
    S = q.new_zeros(B, H, Dk, Dv)
    o = q.new_empty(N, B, H, C, Dv)
    for n in range(N):
        u = U[n] - W[n] @ S
        o[n] = q_out[n] @ S + qk[n] @ u
        S = decay_end[n] * S + k_end[n] @ u
    return o.permute(1, 0, 3, 2, 4).reshape(B, N * C, H, Dv)[:, :T].to(dtype)


def chunk_size(g: torch.Tensor, max_decay: float = 80.0) -> int:
    """The largest C in 64, 32, ..., 1 whose chunks of g [B, T, H, Dk] sum to no less than -max_decay."""
    T = g.shape[1]
    for C in (64, 32, 16, 8, 4, 2):
        chunks = F.pad(g.float(), (0, 0, 0, 0, 0, -T % C)).unflatten(1, (-1, C)).sum(2)
        if chunks.numel() == 0 or -chunks.min() <= max_decay:
            return C
    return 1


@functools.cache
def fla_chunk_kda():
    """flash-linear-attention's chunk kernel, or None where it is not installed (it needs triton)."""
    try:
        from fla.ops.kda import chunk_kda
    except ImportError:
        return None
    return chunk_kda


def kda(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """KDA over whole sequences from a zero state, with q and k as the short convolutions give them:
    fla's kernel on CUDA when installed (it normalizes q and k itself), else `kda_chunked`."""
    scale = q.shape[-1] ** -0.5
    chunk_kda = fla_chunk_kda() if q.is_cuda else None
    if chunk_kda is None:
        return kda_chunked(l2norm(q) * scale, l2norm(k), v, g, beta)
    o, _ = chunk_kda(q, k, v, g.float(), beta.to(v.dtype), scale=scale, use_qk_l2norm_in_kernel=True)
    return o.to(v.dtype)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum x^2 + eps) per head, in fp32 (the reference's form: eps inside the root)."""
    x = x.float()
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


class ShortConv(nn.Module):
    """Causal depthwise conv1d with kernel K and no bias, then SiLU: weight [C, 1, K]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        T, K = x_BTC.shape[1], self.weight.shape[-1]
        y = F.conv1d(x_BTC.transpose(1, 2), self.weight, padding=K - 1, groups=x_BTC.shape[-1])
        return F.silu(y[..., :T]).transpose(1, 2)


class KimiDeltaAttention(nn.Module):
    """The KDA layer: q, k, v through short convolutions; per-channel decay from a low-rank
    projection; beta per head; gated RMSNorm of the output per head.

    Decay: exp(-exp(A_log_h) * softplus(f_b(f_a x) + dt_bias)) (Kimi-Linear), or, with a gate
    lower bound lb (Kimi-K3), exp(lb * sigmoid(exp(A_log_h) * (f_b(f_a x) + dt_bias))).
    A_log has the shape of its config ([1, 1, H, 1] in Kimi-Linear, [H] in Kimi-K3, whose
    checkpoints pad it: the loader reads the first H entries)."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        head_dim: int,
        conv_kernel: int,
        a_log_shape: tuple[int, ...],
        lower_bound: float | None,
        full_rank_gate: bool,
        eps: float,
    ):
        super().__init__()
        self.heads, self.head_dim, self.lower_bound = heads, head_dim, lower_bound
        P = heads * head_dim
        self.q_proj, self.k_proj, self.v_proj = Linear(hidden, P), Linear(hidden, P), Linear(hidden, P)
        self.q_conv1d, self.k_conv1d, self.v_conv1d = (ShortConv(P, conv_kernel) for _ in range(3))
        self.A_log = nn.Parameter(torch.empty(a_log_shape))
        self.dt_bias = nn.Parameter(torch.empty(P))
        self.f_a_proj = Linear(hidden, head_dim)
        self.f_b_proj = Linear(head_dim, P)
        self.b_proj = Linear(hidden, heads)
        if full_rank_gate:
            self.g_proj = Linear(hidden, P)
        else:
            self.g_a_proj = Linear(hidden, head_dim)
            self.g_b_proj = Linear(head_dim, P)
        self.o_norm = RMSNorm(head_dim, eps)
        self.o_proj = Linear(P, hidden)
        self.full_rank_gate = full_rank_gate

    def log_decay(self, x_BTD: torch.Tensor) -> torch.Tensor:
        """g [B, T, H, Dk] in fp32, <= 0."""
        a = (self.f_b_proj(self.f_a_proj(x_BTD)).float() + self.dt_bias.float()).unflatten(-1, (self.heads, -1))
        rate = self.A_log.float().reshape(-1)[: self.heads, None].exp()
        if self.lower_bound is None:
            return -rate * F.softplus(a)
        return self.lower_bound * torch.sigmoid(rate * a)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        heads = (self.heads, self.head_dim)
        q = self.q_conv1d(self.q_proj(x_BTD)).unflatten(-1, heads)
        k = self.k_conv1d(self.k_proj(x_BTD)).unflatten(-1, heads)
        v = self.v_conv1d(self.v_proj(x_BTD)).unflatten(-1, heads)
        beta = torch.sigmoid(self.b_proj(x_BTD).float())
        o = kda(q, k, v, self.log_decay(x_BTD), beta)
        gate = self.g_proj(x_BTD) if self.full_rank_gate else self.g_b_proj(self.g_a_proj(x_BTD))
        return self.o_proj(self.gated_norm(o, gate.unflatten(-1, heads)).flatten(-2))

    def gated_norm(self, o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        """rmsnorm(o) * o_norm.weight * sigmoid(gate), all in fp32 as the reference, cast back once."""
        o32 = o.float()
        o32 = o32 * torch.rsqrt(o32.pow(2).mean(-1, keepdim=True) + self.o_norm.eps)
        return (o32 * self.o_norm.weight.float() * torch.sigmoid(gate.float())).to(o.dtype)
