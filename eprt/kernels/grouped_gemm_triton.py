"""Triton grouped GEMM. Imported only when a CUDA tensor asks for it, or by the tests.

Batch invariant by construction: a program owns one [BLOCK_M, BLOCK_N] output tile of one
expert, tiles start at the expert's first row, and the K loop always runs in BLOCK_K steps
from k = 0 with one fp32 accumulator. The block sizes depend only on the dtype, never on M
(no autotuning over M, no split-K), so a row's result depends on the row, its expert's
weight and (K, N) alone.
"""

import torch
import triton
import triton.language as tl

from eprt.kernels.backend import triton_interpreting

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). fp32 runs true-fp32 dots ("ieee",
# not tf32), which want a shorter K step to fit the pipelined tiles in shared memory.
_CONFIGS = {
    torch.bfloat16: (64, 128, 64, 4, 3),
    torch.float16: (64, 128, 64, 4, 3),
    torch.float32: (64, 128, 32, 4, 3),
}


@triton.jit
def _grouped_mm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    offsets_ptr,
    tile_expert_ptr,
    tile_row_ptr,
    N,
    K,
    E,
    stride_xm,
    stride_xk,
    stride_we,
    stride_wn,
    stride_wk,
    stride_ym,
    stride_yn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
    IEEE_FP32: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_t)
    # The grid is sized for the worst case without reading offsets on the host; spare
    # programs find no expert and leave.
    if e >= E:
        return
    row_end = tl.load(offsets_ptr + e)
    offs_m = tl.load(tile_row_ptr + pid_t).to(tl.int64) + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < row_end
    mask_n = offs_n < N
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk
    w_ptrs = w_ptr + e.to(tl.int64) * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None] * stride_wk
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        mask_k = offs_k < K - k0
        a = tl.load(x_ptrs, mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        if UPCAST:
            # The interpreter multiplies bf16 tiles wrongly; fp32 tiles give the exact
            # products that a bf16 tensor-core dot accumulates in fp32.
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE_FP32:
            acc = tl.dot(a, b, acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b, acc)
        x_ptrs += BLOCK_K * stride_xk
        w_ptrs += BLOCK_K * stride_wk
    y_ptrs = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :] * stride_yn
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def tile_schedule(offsets: torch.Tensor, M: int, block_m: int):
    """Per program: its expert (E for a spare program) and its first row, computed on device.

    Expert e's rows [start_e, end_e) are cut into ceil(count_e / block_m) tiles starting at
    start_e. The grid has ceil(M / block_m) + E programs, enough for any offsets that sum to
    M, so nothing is read back to the host.
    """
    E = offsets.numel()
    ends = offsets.to(torch.int64)
    counts = ends.diff(prepend=ends.new_zeros(1))
    tiles = (counts + block_m - 1) // block_m
    tile_end = tiles.cumsum(0)
    tid = torch.arange(triton.cdiv(M, block_m) + E, device=offsets.device)
    tile_expert = torch.searchsorted(tile_end, tid, right=True)
    e = tile_expert.clamp(max=E - 1)
    tile_row = (ends - counts)[e] + (tid - (tile_end - tiles)[e]) * block_m
    return tile_expert.to(torch.int32), tile_row.to(torch.int32)


def grouped_mm_triton(
    x: torch.Tensor,
    w: torch.Tensor,
    offsets: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
) -> torch.Tensor:
    """Triton `grouped_mm`. The block overrides exist for tests; the default depends on dtype only."""
    M, K = x.shape
    E, N, _ = w.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return y
    bm, bn, bk, num_warps, num_stages = _CONFIGS[x.dtype]
    bm, bn, bk = block_m or bm, block_n or bn, block_k or bk
    tile_expert, tile_row = tile_schedule(offsets, M, bm)
    interpreting = triton_interpreting()
    grid = (tile_expert.numel(), triton.cdiv(N, bn))
    _grouped_mm_kernel[grid](
        x,
        w,
        y,
        offsets,
        tile_expert,
        tile_row,
        N,
        K,
        E,
        x.stride(0),
        x.stride(1),
        w.stride(0),
        w.stride(1),
        w.stride(2),
        y.stride(0),
        y.stride(1),
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=bk,
        UPCAST=interpreting and x.dtype != torch.float32,
        IEEE_FP32=interpreting or x.dtype == torch.float32,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return y
