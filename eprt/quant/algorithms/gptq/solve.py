"""GPTQ (Frantar et al., 2022) in the export's numerics, with a Hessian that is the same bits at
every layout.

The Hessian of a Linear is H = sum over its calibration rows of x x^T. Floating-point sums are not
associative, so a sum whose order follows the world, ep, batch or chunk split would change its last
bits with the layout, and GPTQ's rounding decisions with them. `HessianSum` sums exactly instead:
each canonical unit's partial X^T X (dense: one calibration sequence; routed experts: one
(expert, group) work unit of the engine) is computed in fp64 on its own, then turned into int64
fixed point with a power-of-two scale 2^shift (multiplying by it is exact; rounding to an integer
is the one, per-unit, rounding), and the integers are summed, locally and by all_reduce SUM, in any
order, with the same result. The shift depends only on the module's input amax (max over the
world: exact under any order) and its token count: every row has |x| <= amax, so every entry of
the whole sum is below tokens * amax^2 < 2^(62 - shift), which int64 holds with room for the
per-unit roundings. The quantum is then 2^-62 of that bound: far below fp64's own rounding of a
partial.

`gptq` is the standard algorithm: dead columns (zero diagonal) are zeroed, 1% of the
mean diagonal is added as damping, the upper Cholesky factor of H^-1 drives a column sweep in
lazy-batch blocks of 128, each column rounded and its error spread over the columns not yet
rounded. It computes in fp64. Each column is rounded in the export's numerics, with scales fixed
from the original weight before the sweep (the format's `columns`, eprt.quant.formats): what GPTQ
returns is exactly representable, and the export writes its codes beside the scales it computes
anyway. With `actorder` (a rule's default, GPTQParams), the sweep visits the columns by descending Hessian diagonal (the inputs
with the most energy first, while the most columns are left to take up their error), each weight
of a stack in its own order; the scales stay those of the columns' own blocks (the "static" order:
the export keeps its layout and needs no index of each column's group).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable

import torch

from eprt.quant.algorithms.registry import GPTQParams
from eprt.quant.formats import weight_format
from eprt.quant.formats.base import ScaledByBlocks

# the defaults of a rule's parameters: columns per lazy-batch block, damping as a fraction of the mean diagonal
BLOCK, DAMP = GPTQParams.block, GPTQParams.damp
FIXED_POINT_BITS = 62  # an entry of the whole sum stays below 2^62: int64 keeps a bit for the roundings


def fixed_point_shift(amax: float, tokens: int) -> int:
    """The power of two an int64 Hessian is scaled by: the largest that keeps tokens * amax^2 below 2^62.

    Computed from two numbers every layout agrees on, with exact float arithmetic (frexp)."""
    bound = float(tokens) * float(amax) ** 2
    if not bound > 0.0 or not math.isfinite(bound):
        return 0
    return FIXED_POINT_BITS - math.frexp(bound)[1]


class HessianSum:
    """sum x x^T over rows x [dim] with |x| <= amax, at most `tokens` rows, added one canonical unit
    at a time (`add`), the same bits whatever the order of the units or how the totals of
    several ranks are summed (int64 `total`, all_reduce SUM). With `block`, only the diagonal
    blocks of that many consecutive channels: [dim / block, block, block] (AWQ's clipping search,
    eprt.quant.algorithms.awq.clip, weighs a quantization block's error by its block of the Hessian)."""

    def __init__(self, dim: int, amax: float, tokens: int, device=None, block: int | None = None):
        self.amax, self.shift = float(amax), fixed_point_shift(amax, tokens)
        self.scale = 2.0**self.shift
        self.block = block
        shape = (dim, dim) if block is None else (dim // block, block, block)
        self.total = torch.zeros(shape, dtype=torch.int64, device=device)
        self._lock = threading.Lock()

    def add(self, x: torch.Tensor, y: torch.Tensor | None = None) -> None:
        """One canonical unit's rows x [n, dim]; with y (rows of the same shape, |y| <= amax too),
        the cross sum x^T y in place of x^T x."""
        if x.shape[0] == 0:
            return
        for rows in (x,) if y is None else (x, y):
            if rows.abs().max().item() > self.amax:  # the bound the shift was chosen for would not hold
                raise ValueError(
                    f"a row reaches {rows.abs().max().item()}, above the calibrated input amax {self.amax}: "
                    "the Hessian pass saw other inputs than the max pass"
                )
        x = x.double()
        if self.block is None:
            unit = x.T @ (x if y is None else y.double())
        else:
            x = x.view(x.shape[0], -1, self.block)
            unit = torch.einsum("nbi,nbj->bij", x, x)
        unit = torch.round(unit.mul_(self.scale)).to(torch.int64)
        with self._lock:  # units may come from several threads at once; an int64 sum is the same in any order
            self.total += unit

    def hessian(self) -> torch.Tensor:
        """fp64 [dim, dim] (or its diagonal blocks): the sum (divided in place: one fp64 matrix, not two, at its peak)."""
        return self.total.double().div_(self.scale)


def columns_of(fmt: str, w: torch.Tensor, scales: torch.Tensor, pieces: int = 1):
    """The column rounding of format `fmt` for original weights w [L, out, in] with their
    per-tensor scales [L], each row of w holding `pieces` weights end to end (a gated routed
    expert's first projection: gate and up), which a format whose blocks span rows quantizes apart."""
    f = weight_format(fmt)
    return f.columns(w, scales, pieces) if f.blocks_span_rows else f.columns(w, scales)


def columns_held_bytes(fmt: str, out_dim: int, in_dim: int) -> int:
    """What the column rounding of format `fmt` holds beside one weight [out_dim, in_dim] for its
    whole solve: a block-scaled format's (eprt.quant.formats.block_columns) export scale grid and
    its fp32 table of each element's block scale, per row one per `scale_width` columns (MX: 4
    bytes per 32 weights, FP8 block: per 128); nothing for the formats that scale per column."""
    f = weight_format(fmt)
    if not isinstance(f, ScaledByBlocks):
        return 0
    dtype, shape = f.modelopt_tensors(out_dim, in_dim)["weight_scale"]
    return math.prod(shape) * dtype.itemsize + out_dim * math.ceil(in_dim / (f.scale_width or in_dim)) * 4


def gptq(
    w: torch.Tensor,
    hessians: Iterable[torch.Tensor],
    cols,
    block: int = BLOCK,
    damp: float = DAMP,
    actorder: bool = False,
) -> torch.Tensor:
    """GPTQ's weights (fp32 [L, out, in], each value exactly representable by `cols`) for a stack
    of weights w [L, out, in] and the Hessians [in, in] of their inputs, in order: a stack
    [L, in, in], or a generator that makes each as it is factored, so that one is held at a time
    beside the factors (none is changed). `actorder`: sweep each weight's columns by descending
    Hessian diagonal.

    Each weight of the stack comes out the same bits as solved alone (so a rank's experts may be
    solved together, whichever they are): the column sweep is elementwise over the stack (the
    rank-1 updates are outer products, one rounding per element), and what reduces (the
    factorization, the lazy-batch updates) runs on one weight at a time."""
    W = w.detach().to(torch.float64, copy=True)
    L, n = W.shape[0], W.shape[-1]
    Hinv = torch.empty(L, n, n, dtype=torch.float64, device=W.device)
    # order[b, i]: the column of weight b the sweep rounds i-th (None: each in its place)
    order = torch.empty(L, n, dtype=torch.int64, device=W.device) if actorder else None
    count = 0
    for b, h in enumerate(hessians):
        h = h.to(device=W.device, dtype=torch.float64)
        if order is not None:
            # stable: columns of equal diagonal (the dead ones) keep their own order, at every layout
            order[b] = torch.argsort(torch.diag(h), descending=True, stable=True)
            # one copy of h, permuted both ways at once: the caller's is dropped as it is handed over
            h, W[b] = h[order[b][:, None], order[b]], W[b][:, order[b]]
        dead = torch.diag(h) == 0
        W[b][:, dead] = 0.0
        Hinv[b] = _inverse_factor(h, dead, damp)
        count += 1
    if count != L:
        raise ValueError(f"GPTQ: {count} Hessians for a stack of {L} weights")
    Q = torch.zeros_like(W, dtype=torch.float32)
    stack = torch.arange(L, device=W.device)
    for i1 in range(0, n, block):
        i2 = min(i1 + block, n)
        W1, Hinv1 = W[:, :, i1:i2].clone(), Hinv[:, i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            w_col, d = W1[:, :, i], Hinv1[:, i, i]
            if order is None:
                q = Q[:, :, i1 + i] = cols.round(i1 + i, w_col)
            else:  # each weight's column back in its own place
                q = Q[stack, :, order[:, i1 + i]] = cols.round(order[:, i1 + i], w_col)
            err = (w_col - q.double()) / d[:, None]
            W1[:, :, i:] -= err[:, :, None] * Hinv1[:, None, i, i:]
            Err1[:, :, i] = err
        for b in range(W.shape[0]):
            W[b, :, i2:] -= Err1[b] @ Hinv[b, i1:i2, i2:]
    return Q


def input_error_aim(w: torch.Tensor, hessian: torch.Tensor, cross: torch.Tensor, damp: float = DAMP) -> torch.Tensor:
    """The weight that best computes, from the quantized inputs the engine feeds, what w [out, in]
    computes from the inputs as they are (GPTAQ's asymmetric calibration, Li et al. 2025): over
    calibration rows x and their quantized x~, argmin_W' sum ||w x - W' x~||^2 = w + w A H^-1, with
    H = sum x~ x~^T (`hessian`) and A = sum (x - x~) x~^T (`cross`), H damped as GPTQ damps it. GPTQ
    of this aim under H then minimises ||w x - Q x~|| itself: w x - W' x~ is orthogonal to every
    x~, so the two objectives differ by a constant. Inputs the format leaves as they are give A = 0
    and the aim is w, bit for bit. fp64 [out, in]."""
    W = w.detach().to(torch.float64)
    A = cross.to(device=W.device, dtype=torch.float64)
    if not A.any():
        return W.clone()
    H = hessian.to(device=W.device, dtype=torch.float64)
    dead = torch.diag(H) == 0
    diag = torch.arange(H.shape[0], device=H.device)
    mean = torch.mean(torch.where(dead, 1.0, torch.diag(H))).item()
    factor = torch.linalg.cholesky(_damped(H, dead, damp * mean, diag))
    # (W A) H^-1, as H (W A)^T solved: H is symmetric
    return W + torch.cholesky_solve((W @ A).T, factor).T


def _inverse_factor(H: torch.Tensor, dead: torch.Tensor, damp: float) -> torch.Tensor:
    """The upper Cholesky factor of (H + damping)^-1, the dead columns' diagonal taken as 1. A
    Hessian that is not positive definite after damping (rank-deficient in fp64) gets ten times
    the damping, up to three times. Beside H it holds at most three matrices of its size at once
    (the factor, the inverse, its factor: the damped copy is dropped once factored)."""
    diag = torch.arange(H.shape[0], device=H.device)
    mean = torch.mean(torch.where(dead, 1.0, torch.diag(H))).item()
    for attempt in range(4):
        L, info = torch.linalg.cholesky_ex(_damped(H, dead, damp * 10**attempt * mean, diag))
        if info.item() == 0:
            U, info = torch.linalg.cholesky_ex(torch.cholesky_inverse(L), upper=True)
            if info.item() == 0:
                return U
    raise ValueError(
        f"GPTQ: the Hessian ({H.shape[0]} columns) is not positive definite even with "
        f"{damp * 1000:g} x its mean diagonal as damping; calibrate with more tokens"
    )


def _damped(H: torch.Tensor, dead: torch.Tensor, damping: float, diag: torch.Tensor) -> torch.Tensor:
    """A copy of H with the dead columns' diagonal set to 1, then `damping` added to the diagonal."""
    Hd = H.clone()
    Hd[dead, dead] = 1.0
    Hd[diag, diag] += damping
    return Hd
