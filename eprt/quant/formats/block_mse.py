"""The `mse` search of the formats whose only scales are a grid of block or row scales
(eprt.quant.formats.base.ScaledByBlocks: FP8 block and per channel, MXFP8, MXFP4).

Each cell of the grid (a 128x128 block, a row, a block of 32) takes, among the format's candidate
grids (`mse_candidates`, max's own first), the scale under which the export decodes the cell
closest to the weight: the squared error of `decode(encode(w, grid), grid)` against w, summed in
float64 over the cell. A tie keeps the earlier candidate, so a cell keeps max's scale unless
another is strictly better, and mse's error is never above max's, cell by cell. The weight alone
decides: no calibration data, the same grid at every layout.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

# Weight elements one step of the search encodes and decodes under each candidate (at least one
# row of cells): bounds its working memory (a few float64 copies of them), not its result.
MSE_CHUNK_ELEMENTS = 1 << 20
# Bytes a chunk element holds during the search: its float64 copy, a candidate's float64 decoding
# squared in place, and the codes and cell sums beside them (the export's memory plan,
# ScaledByBlocks.mse_search_bytes).
MSE_BYTES_PER_CHUNK_ELEMENT = 32


def chunk_rows(in_dim: int, height: int) -> int:
    """Rows of a weight of `in_dim` columns one step of the search takes: whole rows of cells
    (`height` rows each), about MSE_CHUNK_ELEMENTS elements, at least one row of cells."""
    return max(1, MSE_CHUNK_ELEMENTS // max(1, in_dim * height)) * height


def mse_grid(fmt, w: torch.Tensor) -> torch.Tensor:
    """The grid of least squared error of `fmt` (a ScaledByBlocks) for w [..., out, in], shaped as
    `fmt.scales_of(w)`; each matrix of a stack is searched on its own."""
    if not w.numel():
        return fmt.scales_of(w)  # no cell to search
    if w.dim() == 2:
        return _searched(fmt, w)
    grids = [_searched(fmt, m) for m in w.reshape(-1, *w.shape[-2:])]
    return torch.stack(grids).reshape(*w.shape[:-2], *grids[0].shape)


def _grid_shape(fmt, out_dim: int, in_dim: int) -> tuple[int, ...]:
    """The shape of the scale grid of a weight [out_dim, in_dim], as `scales_of` gives it."""
    return fmt.modelopt_tensors(out_dim, in_dim)["weight_scale"][1]


def _searched(fmt, w: torch.Tensor) -> torch.Tensor:
    out_dim, in_dim = w.shape
    candidates = fmt.mse_candidates(w)  # raises for NaN or infinity, naming w's shape
    height = fmt.scale_height
    # each grid as rows of cells, a row of cells `height` weight rows (a per-channel grid: [out, 1])
    rows = [c.reshape(math.ceil(out_dim / height), -1) for c in candidates]
    best = rows[0].clone()
    step = chunk_rows(in_dim, height)
    for a in range(0, out_dim, step):
        b = min(a + step, out_dim)
        cells, shape = slice(a // height, math.ceil(b / height)), _grid_shape(fmt, b - a, in_dim)
        part, x = w[a:b], w[a:b].double()
        best_err = None
        for grid in rows:
            g = grid[cells].reshape(shape)
            err = cell_sums(fmt, fmt.decode(fmt.encode(part, g), g, torch.float64).sub_(x).square_())
            if best_err is None:  # max's own
                best_err = err
                continue
            better = err < best_err  # strictly: a tie keeps the earlier candidate
            best[cells] = torch.where(better, grid[cells], best[cells])
            best_err = torch.where(better, err, best_err)
    return best.reshape(candidates[0].shape)


def cell_sums(fmt, x: torch.Tensor) -> torch.Tensor:
    """x [rows, in] summed over each cell of `fmt`'s grid, as rows of cells [ceil(rows/height),
    cells a row]; a partial edge cell sums what it holds."""
    rows, in_dim = x.shape
    height, width = fmt.scale_height, fmt.scale_width or in_dim  # None: the row
    padded = F.pad(x, (0, -in_dim % width, 0, -rows % height))
    return padded.reshape(padded.shape[0] // height, height, -1, width).sum(dim=(1, 3))
