"""An orthogonal rotation of any width: a randomised Hadamard transform.

QuaRot's and SpinQuant's rotations are Hadamard matrices with random signs: each output channel
is a ±1/√n mix of every input channel, so an outlier channel is spread over all of them and a
quantization block no longer holds one large value among small ones. A Hadamard matrix of width
n exists for n a power of two (Sylvester's construction); the widths of real models are not all
powers of two (DeepSeek-V3's 7168 = 7 · 1024, GLM-4.5's 5120 = 5 · 1024), so the width is split
as n = m · b with b the largest power of two dividing it and the rotation is

    Q = diag(signs) · (C_m ⊗ H_b)

with H_b the normalised Sylvester-Hadamard matrix, C_m the orthonormal DCT-II matrix of the odd
part m (the identity for m = 1) and `signs` ±1 drawn from a seeded generator. Each factor is
orthogonal, so Q is: Qᵀ Q = I. The Hadamard part mixes each block of b consecutive channels
(b ≥ 1024 at real widths: far wider than any quantization block) and the DCT mixes the blocks.
Every factor is deterministic (no LAPACK call), so the same width and seed give the same Q on
every machine and rank.

`rotate(x, r)` computes x @ Q over x's last dimension in O(n log n) per row, in fp64, without
forming Q.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Rotation:
    """Q = diag(signs) · (C_m ⊗ H_b) for width n = m · b (module docstring)."""

    signs: torch.Tensor  # [n] fp64, ±1
    mix: torch.Tensor  # C_m [m, m] fp64
    block: int  # b, a power of two

    @property
    def width(self) -> int:
        return self.signs.numel()

    def matrix(self) -> torch.Tensor:
        """Q itself [n, n] fp64 (for tests and small widths)."""
        return rotate(torch.eye(self.width, dtype=torch.float64), self)


def random_hadamard(n: int, seed: int) -> Rotation:
    """The randomised Hadamard rotation of width `n` drawn with `seed`."""
    if n < 1:
        raise ValueError(f"a rotation's width must be positive, not {n}")
    block = n & -n  # the largest power of two dividing n
    g = torch.Generator().manual_seed(seed)
    signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64).mul_(2).sub_(1)
    return Rotation(signs, dct(n // block), block)


def dct(m: int) -> torch.Tensor:
    """The orthonormal DCT-II matrix C [m, m] (rows are the basis vectors: C Cᵀ = I)."""
    k = torch.arange(m, dtype=torch.float64)
    c = torch.cos(math.pi * (k[None, :] + 0.5) * k[:, None] / m) * math.sqrt(2.0 / m)
    c[0] /= math.sqrt(2.0)
    return c


def rotate(x: torch.Tensor, r: Rotation) -> torch.Tensor:
    """x @ Q over x's last dimension (r.width wide), in fp64."""
    n, b = r.width, r.block
    if x.shape[-1] != n:
        raise ValueError(f"a rotation of width {n} applied to a tensor of shape {tuple(x.shape)}")
    lead = x.shape[:-1]
    y = (x.to(torch.float64) * r.signs).reshape(-1, n // b, b)
    y = walsh_hadamard(y)
    # x @ (C ⊗ H): input block j reaches output block i with weight C[j, i]
    y = torch.einsum("rjp,ji->rip", y, r.mix)
    return y.reshape(*lead, n)


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """x @ H_b over the last dimension (b a power of two), H_b Sylvester's, normalised by 1/√b."""
    b = x.shape[-1]
    lead = x.shape[:-1]
    h = 1
    while h < b:
        y = x.reshape(*lead, b // (2 * h), 2, h)
        x = torch.stack([y[..., 0, :] + y[..., 1, :], y[..., 0, :] - y[..., 1, :]], dim=-2).reshape(*lead, b)
        h *= 2
    return x / math.sqrt(b)
