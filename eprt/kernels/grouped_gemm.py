"""Grouped GEMM over a contiguous range of experts."""

import torch


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y[rows of expert e] = x[rows of expert e] @ w[e].T, accumulated in fp32.

    x: [M, K], rows sorted by expert; w: [E, N, K]; offsets: int32 [E], cumulative row
    counts (offsets[e] is the end of expert e's rows). Returns [M, N] in x's dtype.
    """
    out = torch.empty(x.shape[0], w.shape[1], dtype=x.dtype, device=x.device)
    start = 0
    for e, end in enumerate(offsets.tolist()):
        if end > start:
            out[start:end] = (x[start:end].float() @ w[e].float().T).to(x.dtype)
        start = end
    return out
