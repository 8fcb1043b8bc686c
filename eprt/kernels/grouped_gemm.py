"""Grouped GEMM over a contiguous range of experts.

Batch invariance is the contract: a row's result depends only on that row, its expert's
weight and the (K, N) shape, never on how many rows its expert holds in the call or where
the row sits among them. The project's layout-independent quantization scales rest on it
(docs/architecture.md, 'Layout-invariant calibration').
"""

import itertools

import torch
import torch.nn.functional as F

from eprt.kernels.backend import check_values, matmul_dtype, use_triton
from eprt.kernels.cpu_workers import for_each

# Rows per tile of the CPU fallback. Every BLAS call it makes multiplies one expert's weight by
# one [CPU_BLOCK_M, K] tile of a zero-padded, 64-byte aligned buffer, so the library sees the
# same shapes, strides and alignment whatever the row counts; plain `x_e @ w_e.T` does not
# (MKL picks other kernels for small or ragged M, and the last bits move).
CPU_BLOCK_M = 64

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ w[e].T (+ b[e], after the rounding to x's dtype),
    accumulated in fp32.

    x: [M, K], rows sorted by expert; w: [E, N, K]; offsets: int32 [E], cumulative row
    counts (offsets[e] is the end of expert e's rows, offsets[-1] == M). Returns [M, N] in
    x's dtype. Bitwise batch invariant on each implementation.
    """
    check_grouped_mm_args(x, w, offsets)
    if use_triton(x):
        from eprt.kernels.grouped_gemm_triton import grouped_mm_triton

        return _plus_bias(grouped_mm_triton(x, w, offsets), b, offsets)
    return _plus_bias(grouped_mm_torch(x, w, offsets), b, offsets)


def check_grouped_mm_args(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> None:
    if x.dim() != 2 or w.dim() != 3:
        raise ValueError(f"grouped_mm wants x [M, K] and w [E, N, K], got {tuple(x.shape)} and {tuple(w.shape)}")
    if x.shape[1] != w.shape[2]:
        raise ValueError(f"grouped_mm: x has K={x.shape[1]} but w has K={w.shape[2]}")
    if x.dtype != w.dtype or x.dtype not in _DTYPES:
        raise ValueError(f"grouped_mm wants x and w of one dtype among {_DTYPES}, got {x.dtype} and {w.dtype}")
    if offsets.dtype != torch.int32 or offsets.shape != (w.shape[0],):
        raise ValueError(f"grouped_mm wants offsets int32 [E={w.shape[0]}], got {offsets.dtype} {tuple(offsets.shape)}")
    if not (x.device == w.device == offsets.device):
        raise ValueError(f"grouped_mm: x, w, offsets on {x.device}, {w.device}, {offsets.device}")
    if offsets.numel() == 0:
        if x.shape[0] != 0:
            raise ValueError(f"grouped_mm: no experts (E=0) but M={x.shape[0]} rows")
        return
    ok = (offsets[-1] == x.shape[0]) & (offsets[0] >= 0) & (offsets.diff() >= 0).all()
    check_values(ok, f"grouped_mm: offsets must be non-decreasing, from >= 0, ending at M={x.shape[0]}")


def grouped_mm_torch(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Batch-invariant torch implementation: fixed [CPU_BLOCK_M, K] tiles, one BLAS call each.

    Each tile is computed transposed, y_tile.T = w[e] @ x_tile.T, so that the tile's rows lie
    along the BLAS's vectorized output dimension, where every lane runs the same sequence of
    multiply-adds. The direct form x_tile @ w[e].T puts them along the other output dimension,
    and there MKL's fp32 kernels for small N give rows a result that depends on their position
    modulo 4. bf16 and fp16 tiles go to the BLAS in `matmul_dtype` (accumulated in fp32 either
    way) and are rounded once to x's dtype.
    """
    M, K = x.shape
    N = w.shape[1]
    ends = offsets.tolist()
    bm = CPU_BLOCK_M
    wide = matmul_dtype(x.dtype, x.device)
    out = x.new_empty(M, N)
    x_tile = x.new_zeros(bm, K, dtype=wide)
    y_tile_T = x.new_empty(N, bm, dtype=wide)
    start = 0
    for e, end in enumerate(ends):
        w_e = _canonical_weight(w[e], wide) if end > start else None
        for row in range(start, end, bm):
            rows = min(bm, end - row)
            x_tile[:rows].copy_(x[row : row + rows])
            x_tile[rows:].zero_()
            torch.mm(w_e, x_tile.T, out=y_tile_T)
            out[row : row + rows].copy_(y_tile_T[:, :rows].T)
        start = end
    return out


def _canonical_weight(w_e: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One expert's weight as the CPU matmuls take it: in `dtype` (a fresh, aligned copy when
    widened), else in the canonical layout."""
    return w_e.to(dtype) if w_e.dtype != dtype else _canonical_layout(w_e)


def _canonical_layout(w_e: torch.Tensor) -> torch.Tensor:
    """w_e itself when contiguous and 64-byte aligned, else such a copy.

    The BLAS takes other paths for other strides or alignments (MKL's fp32 result moves with
    the weight's alignment at small N), and where a weight starts depends on how many experts
    a rank holds before it, so every expert goes to the BLAS in the one layout.
    """
    if w_e.is_contiguous() and w_e.data_ptr() % 64 == 0:
        return w_e
    return w_e.clone(memory_format=torch.contiguous_format)


def grouped_mm_loop(
    x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor, b: torch.Tensor | None = None
) -> torch.Tensor:
    """The plain per-expert loop, in fp32: the reference the tests compare against."""
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = (x[start:end].float() @ w[e].float().T).to(x.dtype)
            if b is not None:
                out[start:end] += b[e]
        start = end
    return out


def unit_mlp(
    x: torch.Tensor,
    w_in: torch.Tensor,
    w_out: torch.Tensor,
    act,
    rows_per_unit_LU: torch.Tensor,
    *,
    gated: bool = True,
    b_in: torch.Tensor | None = None,
    b_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert MLP over work units: (h, y) with, for the rows of unit (e, u), z = x @ w_in[e].T
    (+ b_in[e]), h = act(gate, up) of z = [gate | up] when `gated`, else act(z), and
    y = h @ w_out[e].T (+ b_out[e]).

    x: [M, K], rows sorted by (expert, unit); w_in: [E, 2I or I, K]; w_out: [E, K', I]; biases
    [E, 2I or I] and [E, K']; rows_per_unit_LU: [E, U] row counts. A unit's result depends only on
    its rows and its expert's weights, however the units are batched into calls: on CUDA through
    Triton's batch-invariant grouped GEMM (and elementwise kernels that treat every element
    alike); on CPU one plain BLAS matmul per unit and projection, and the activation per unit
    too, because the CPU's vectorized elementwise loops give an element other bits in the scalar
    tail than in a vector lane, and where an element falls depends on everything before it in
    the call. The CPU matmuls run in `matmul_dtype` (fp32 for bf16 on a CPU without bf16
    arithmetic), each result rounded once to x's dtype before the bias and the activation, as
    the low-precision GEMM rounds it."""
    offsets = torch.cumsum(rows_per_unit_LU.sum(1), dim=0, dtype=torch.int32)
    check_grouped_mm_args(x, w_in, offsets)
    if use_triton(x):
        from eprt.kernels.grouped_gemm_triton import grouped_mm_triton

        h = _activate(_plus_bias(grouped_mm_triton(x, w_in, offsets), b_in, offsets), act, gated)
        return h, _plus_bias(grouped_mm_triton(h, w_out, offsets), b_out, offsets)
    h = x.new_empty(x.shape[0], w_out.shape[2])
    y = x.new_empty(x.shape[0], w_out.shape[1])
    wide = matmul_dtype(x.dtype, x.device)
    counts_EU = rows_per_unit_LU.tolist()
    starts = list(itertools.accumulate((sum(c) for c in counts_EU), initial=0))

    def expert(e: int, _) -> None:
        w_in_e, w_out_e = _canonical_weight(w_in[e], wide), _canonical_weight(w_out[e], wide)
        bias_in, bias_out = (None if b is None else b[e] for b in (b_in, b_out))
        start = starts[e]
        for n in counts_EU[e]:
            if n:
                h_u = _unit_act(x[start : start + n], w_in_e, bias_in, act, gated)
                h[start : start + n] = h_u
                y_u = _unit_rows_mm(h_u, w_out_e)
                y[start : start + n] = y_u if bias_out is None else y_u + bias_out
                start += n

    # experts write disjoint rows: on CPU they may run on eprt.kernels.cpu_workers' threads
    for_each([e for e in range(len(counts_EU)) if starts[e + 1] > starts[e]], lambda: None, expert, x.device)
    return h, y


def unit_act(
    x: torch.Tensor,
    w_in: torch.Tensor,
    act,
    rows_per_unit_U: torch.Tensor,
    *,
    gated: bool = True,
    b_in: torch.Tensor | None = None,
) -> torch.Tensor:
    """`unit_mlp`'s h for ONE expert (w_in: [1, 2I or I, K], b_in [1, 2I or I]) over rows sorted by
    work unit (rows_per_unit_U [U] row counts): each unit's h has the bits `unit_mlp` gives that
    unit, its rows alone. No down projection: what reads h only measures it."""
    offsets = torch.tensor([x.shape[0]], dtype=torch.int32, device=x.device)
    check_grouped_mm_args(x, w_in, offsets)
    if use_triton(x):
        from eprt.kernels.grouped_gemm_triton import grouped_mm_triton

        return _activate(_plus_bias(grouped_mm_triton(x, w_in, offsets), b_in, offsets), act, gated)
    h = x.new_empty(x.shape[0], w_in.shape[1] // (2 if gated else 1))
    w_in_e = _canonical_weight(w_in[0], matmul_dtype(x.dtype, x.device))
    bias_in = None if b_in is None else b_in[0]
    start = 0
    for n in rows_per_unit_U.tolist():
        if n:
            h[start : start + n] = _unit_act(x[start : start + n], w_in_e, bias_in, act, gated)
            start += n
    return h


def _unit_act(x_u: torch.Tensor, w_in_e: torch.Tensor, b_in_e: torch.Tensor | None, act, gated: bool) -> torch.Tensor:
    """One unit's activation on CPU, its rows alone (`_unit_rows_mm`), the bias and activation on them alone."""
    z = _unit_rows_mm(x_u, w_in_e)
    return _activate(z if b_in_e is None else z + b_in_e, act, gated)


def _activate(z: torch.Tensor, act, gated: bool) -> torch.Tensor:
    """act(gate, up) of z = [gate | up], or act(z) for experts that are not gated."""
    return act(*z.chunk(2, dim=-1)) if gated else act(z)


def _plus_bias(y: torch.Tensor, b: torch.Tensor | None, offsets: torch.Tensor) -> torch.Tensor:
    """y with each expert's bias row added to its rows (rows sorted by expert, cumulative `offsets`)."""
    if b is None:
        return y
    counts = torch.diff(offsets, prepend=offsets.new_zeros(1))
    return y + b.repeat_interleave(counts, dim=0, output_size=y.shape[0])


# A unit's rows go to a low-precision BLAS zero-padded to a multiple of this many. oneDNN (bf16
# on CPU) caches a primitive, with its buffers, for every distinct row count it is given, and
# units come in every count: unpadded, the cache grows by ~0.7 MB per count until it holds
# hundreds of MB. Padded, a layer's units take a few dozen shapes.
UNIT_ROW_BUCKET = 32


def _unit_rows_mm(x_u: torch.Tensor, w_e: torch.Tensor) -> torch.Tensor:
    """x_u @ w_e.T in x_u's dtype, as the BLAS computes it for these rows alone, wherever x_u
    starts. Through F.linear: for bf16 on CPU about twice as fast as torch.mm of the transposed
    weight. A wider w_e (`_canonical_weight`) widens the rows into a fresh buffer, which the
    fp32 GEMM takes without a primitive cache; a low-precision unit is padded, by a function
    of its row count alone, so every layout pads it alike."""
    if w_e.dtype != x_u.dtype:
        return F.linear(x_u.to(w_e.dtype), w_e).to(x_u.dtype)
    n = x_u.shape[0]
    if n % UNIT_ROW_BUCKET == 0:
        return F.linear(_canonical_layout(x_u), w_e)
    padded = x_u.new_zeros(-(-n // UNIT_ROW_BUCKET) * UNIT_ROW_BUCKET, x_u.shape[1])
    padded[:n] = x_u
    return F.linear(padded, w_e)[:n]
