"""Triton permute (row gather) and combine (weighted sum over k, k in order).

Imported only when a CUDA tensor asks for it, or by the tests.
"""

import torch
import triton
import triton.language as tl

from eprt.kernels.expert_order import slots, sort_by_expert

# Columns per program. Rows are short (hidden sizes of a few thousand) and each program only
# streams memory, so a wide block keeps the grid small.
_BLOCK_D = 1024


@triton.jit
def _gather_rows_kernel(x_ptr, order_ptr, out_ptr, D, TOPK, stride_x, stride_out, BLOCK_D: tl.constexpr):
    j = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    src = (tl.load(order_ptr + j) // TOPK).to(tl.int64)
    row = tl.load(x_ptr + src * stride_x + offs, mask=mask)
    tl.store(out_ptr + j.to(tl.int64) * stride_out + offs, row, mask=mask)


@triton.jit
def _combine_kernel(
    y_ptr, slot_ptr, w_ptr, out_ptr, D, TOPK, stride_y, stride_wt, stride_wk, stride_out, BLOCK_D: tl.constexpr
):
    t = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = offs < D
    acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
    # k runs 0, 1, ... in one accumulator: the fixed order the contract promises.
    for k in range(0, TOPK):
        j = tl.load(slot_ptr + t.to(tl.int64) * TOPK + k).to(tl.int64)
        wk = tl.load(w_ptr + t.to(tl.int64) * stride_wt + k * stride_wk).to(tl.float32)
        yk = tl.load(y_ptr + j * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
        acc = acc + wk * yk
    tl.store(out_ptr + t.to(tl.int64) * stride_out + offs, acc, mask=mask)


def permute_triton(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, num_experts: int):
    """Triton `permute`: the sort stays in torch, the row gather is a kernel."""
    T, D = x_TD.shape
    K = expert_ids_TK.shape[1]
    order, tokens_per_expert = sort_by_expert(expert_ids_TK, num_experts)
    x_sorted = x_TD.new_empty(T * K, D)
    if T * K and D:
        x = x_TD if x_TD.stride(1) == 1 else x_TD.contiguous()
        grid = (T * K, triton.cdiv(D, _BLOCK_D))
        _gather_rows_kernel[grid](x, order, x_sorted, D, K, x.stride(0), x_sorted.stride(0), BLOCK_D=_BLOCK_D)
    return x_sorted, tokens_per_expert, order


def combine_triton(y_sorted: torch.Tensor, order: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Triton `combine`."""
    T, K = weights_TK.shape
    D = y_sorted.shape[1]
    out = torch.empty(T, D, dtype=torch.float32, device=y_sorted.device)
    if T and D:
        slot = slots(order)
        y = y_sorted if y_sorted.stride(1) == 1 else y_sorted.contiguous()
        grid = (T, triton.cdiv(D, _BLOCK_D))
        _combine_kernel[grid](
            y,
            slot,
            weights_TK,
            out,
            D,
            K,
            y.stride(0),
            weights_TK.stride(0),
            weights_TK.stride(1),
            out.stride(0),
            BLOCK_D=_BLOCK_D,
            # Separate multiply and add, as the torch fallback does: no FMA contraction.
            enable_fp_fusion=False,
        )
    return out
