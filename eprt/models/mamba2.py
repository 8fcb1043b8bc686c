"""Mamba-2's mixer (Nemotron-H): a selective state-space model run over whole sequences.

in_proj gives, per token, the output gate z, the scan's input x with its B and C (one B and C per
group of heads), and one time step per head. x, B and C go through a causal depthwise conv1d and
SiLU; the state-space duality scan (SSD) then runs per head h with a scalar decay:

    dt = clamp(softplus(dt + dt_bias), time-step limits),  A = -exp(A_log)
    state_t = exp(dt_t A) state_{t-1} + dt_t x_t B_t^T,   y_t = state_t C_t + D x_t

and out_proj reads y gated and normalized per group of heads: RMSNorm_g(y * silu(z)) * weight.

PTQ runs full sequences, so nothing is carried for decoding (no conv or SSM state cache). The
scan runs chunk by chunk in plain torch, in fp32: within a chunk as a masked matrix product, across
chunks by carrying the [H, P, N] state, so memory is bounded by the chunk, not the sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eprt.models.balance import Balance, BalanceGroup, Unbalanced
from eprt.models.layers import Linear


def segment_sum(a_BHL: torch.Tensor) -> torch.Tensor:
    """[B, H, L, L]: entry (l, s) the sum of a over (s, l] for s <= l, -inf above the diagonal;
    summed from the masked steps themselves, not as a difference of cumulative sums, whose
    cancellation loses digits over long chunks."""
    L = a_BHL.shape[-1]
    causal = torch.ones(L, L, dtype=torch.bool, device=a_BHL.device).tril()
    steps = a_BHL[..., :, None].expand(*a_BHL.shape, L)  # (l, s) -> a[l]
    sums = steps.masked_fill(~causal.tril(-1), 0).cumsum(dim=-2)
    return sums.masked_fill(~causal, float("-inf"))


def ssd_scan(
    x_BTHP: torch.Tensor,
    dt_BTH: torch.Tensor,
    A_H: torch.Tensor,
    B_BTGN: torch.Tensor,
    C_BTGN: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """The scan's output y [B, T, H, P] in fp32 (without the D skip) from the fp32 inputs: x, the
    time steps dt (after softplus and clamping), A, and B and C one per group of H / G heads (each
    chunk's widened to one per head as it runs)."""
    Bsz, T, H, P = x_BTHP.shape
    per_group = H // B_BTGN.shape[2]
    state = x_BTHP.new_zeros(Bsz, H, P, B_BTGN.shape[-1])
    ys = []
    for s in range(0, T, chunk):
        x, dt = x_BTHP[:, s : s + chunk], dt_BTH[:, s : s + chunk]
        Bc, Cc = (m[:, s : s + chunk].repeat_interleave(per_group, dim=2) for m in (B_BTGN, C_BTGN))
        xdt = x * dt[..., None]
        a_BHL = (A_H * dt).transpose(1, 2)
        within_BHL = a_BHL.cumsum(-1)  # the decay from the chunk's start through each step
        decay_BHLS = segment_sum(a_BHL).exp()
        scores_BLSH = torch.einsum("blhn,bshn->blsh", Cc, Bc) * decay_BHLS.permute(0, 2, 3, 1)
        y_diag = torch.einsum("blsh,bshp->blhp", scores_BLSH, xdt)
        y_state = torch.einsum("blhn,bhpn->blhp", Cc, state) * within_BHL.exp().permute(0, 2, 1)[..., None]
        ys.append(y_diag + y_state)
        to_end_BLH = (within_BHL[..., -1:] - within_BHL).exp().transpose(1, 2)
        added = torch.einsum("blhn,blhp->bhpn", Bc * to_end_BLH[..., None], xdt)
        state = state * within_BHL[..., -1].exp()[..., None, None] + added
    return torch.cat(ys, dim=1)


class GatedGroupRMSNorm(nn.Module):
    """RMSNorm of y * silu(z) over each of `groups` equal runs of channels, in fp32, then the weight."""

    def __init__(self, dim: int, groups: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.groups, self.eps = groups, eps

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = y.float() * F.silu(z.float())
        g = h.unflatten(-1, (self.groups, -1))
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        # the reference multiplies the weight into the normalized value in y's dtype (fp32: the scan's)
        return self.weight * g.flatten(-2).to(y.dtype)


class Mamba2Mixer(nn.Module):
    """Mamba-2 with `heads` heads of `head_dim` channels, a state of `state_size` per head, B and C
    shared by the heads of each of `groups` groups, a causal conv of `conv_kernel` taps, time steps
    clamped to `dt_limit`, the scan run `chunk` tokens at a time."""

    def __init__(
        self,
        hidden: int,
        heads: int,
        head_dim: int,
        state_size: int,
        groups: int,
        conv_kernel: int,
        conv_bias: bool,
        dt_limit: tuple[float, float],
        chunk: int,
        eps: float,
    ):
        super().__init__()
        assert heads % groups == 0, (heads, groups)
        self.heads, self.head_dim, self.state_size, self.groups = heads, head_dim, state_size, groups
        self.inner = heads * head_dim
        self.conv_dim = self.inner + 2 * groups * state_size
        self.dt_limit, self.chunk = dt_limit, chunk
        self.in_proj = Linear(hidden, self.inner + self.conv_dim + heads)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, conv_kernel, groups=self.conv_dim, bias=conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(heads))
        self.A_log = nn.Parameter(torch.empty(heads))
        self.D = nn.Parameter(torch.empty(heads))
        self.norm = GatedGroupRMSNorm(self.inner, groups, eps)
        self.out_proj = Linear(self.inner, hidden)

    def balance_groups(self, norm: nn.Module) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): in_proj reads the norm's output; out_proj reads a
        gated, normalized scan, which no scale passes through."""
        return [
            BalanceGroup("Mamba input", norm, self.input_readers()),
            Unbalanced(self.out_proj, "its input: a gated RMSNorm sits between the scan and out_proj"),
        ]

    def input_readers(self) -> tuple[nn.Module, ...]:
        return (self.in_proj,)

    def conv(self, xBC_BTC: torch.Tensor) -> torch.Tensor:
        """The causal depthwise conv (each output reads its own and the kernel - 1 earlier steps), then SiLU."""
        K = self.conv1d.kernel_size[0]
        padded = F.pad(xBC_BTC.transpose(1, 2), (K - 1, 0))
        out = F.conv1d(padded, self.conv1d.weight, self.conv1d.bias, groups=self.conv_dim)
        return F.silu(out).transpose(1, 2)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        Bsz, T, _ = x_BTD.shape
        H, P, G, N = self.heads, self.head_dim, self.groups, self.state_size
        z, xBC, dt = self.in_proj(x_BTD).split([self.inner, self.conv_dim, H], dim=-1)
        x, B, C = self.conv(xBC).split([self.inner, G * N, G * N], dim=-1)
        # the time step in the model dtype, as the reference computes it, then fp32 like the rest
        dt = F.softplus(dt + self.dt_bias.to(dt.dtype)).clamp(*self.dt_limit).float()
        x32 = x.float().view(Bsz, T, H, P)
        B, C = (m.float().view(Bsz, T, G, N) for m in (B, C))
        y = ssd_scan(x32, dt, -torch.exp(self.A_log.float()), B, C, self.chunk)
        y = y + self.D.float()[:, None] * x32
        return self.out_proj(self.norm(y.reshape(Bsz, T, self.inner), z).to(x_BTD.dtype))
