"""GPTQ's column quantizer (eprt.quant.algorithms.gptq.solve) for the formats whose only scales are a grid of block
or row scales (eprt.quant.formats.base.ScaledByBlocks: FP8 block and per channel, MXFP8, MXFP4).

The grid is the export's own, from the original weight (`scales_of`), fixed before the sweep: the
export computes it from that weight anyway and writes GPTQ's codes beside it. Each element of
column j lies in one block of the grid (FP8 block: 128 rows by 128 columns, a partial edge block
included; MX: 32 columns of its row; per channel: its whole row) and is rounded as the export
rounds it: its fp32 quotient by that block's scale rounded to the element format
(`round_quotient`), times the scale, the export's decoding. A value GPTQ has moved beyond its
block's original amax saturates, as the export's encoder does under the same scale; so what
`round` returns is exactly representable, `encode` (the export's encoder under the grid) gives its
codes, and `decode` (the export's decoding) gives it back.

A gated routed expert's first stacked projection holds gate and up end to end along its rows, quantized apart, each in blocks
of its own, where the format's blocks span rows (FP8 block, `blocks_span_rows`): `pieces` says how
many weights a row of the stack holds, and each has its own grid.
"""

from __future__ import annotations

import torch

from eprt.quant.numerics import to_e4m3


def column_block(t: torch.Tensor, j: int | torch.Tensor, width: int) -> torch.Tensor:
    """[L, out] of t [L, out, blocks along a row]: the block of column j, j one column for the whole
    stack or, where GPTQ sweeps each weight in its own order (`actorder`), a column per weight [L]."""
    if isinstance(j, int):
        return t[:, :, j // width]
    return t[torch.arange(t.shape[0], device=t.device), :, j.to(t.device) // width]


class BlockColumns:
    """GPTQ's columns of `fmt` (a ScaledByBlocks) for a stack of original weights w [L, out, in],
    each row of which holds `pieces` weights end to end."""

    def __init__(self, fmt, w: torch.Tensor, pieces: int = 1):
        self.fmt = fmt
        self.pieces = pieces if fmt.blocks_span_rows else 1  # rows are quantized apart otherwise
        parts = w.chunk(self.pieces, dim=-2)
        self.grids = [fmt.scales_of(p) for p in parts]
        # fp32 [L, out, blocks along a row]: the scale each element is divided by, its block's
        self.row_scales = torch.cat([fmt.row_scales(g, p.shape[-2]) for g, p in zip(self.grids, parts)], dim=-2)
        self.width = fmt.scale_width or w.shape[-1]  # columns under one scale of a row

    def round(self, j: int | torch.Tensor, col_LO: torch.Tensor) -> torch.Tensor:
        """fp32 [L, out]: column j's values as the export encodes and decodes them."""
        s = column_block(self.row_scales, j, self.width).to(col_LO.device)
        return self.fmt.round_quotient(col_LO.float() / s).mul_(s)

    def encode(self, q: torch.Tensor) -> torch.Tensor:
        """The export's codes [L, out, ...] of GPTQ's weights q [L, out, in] under the grid."""
        parts = q.float().chunk(self.pieces, dim=-2)
        return torch.cat([self.fmt.encode(p, g.to(q.device)) for p, g in zip(parts, self.grids)], dim=-2)

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        """fp32 [L, out, in]: the values of the export's codes under the grid."""
        parts = codes.chunk(self.pieces, dim=-2)
        return torch.cat([self.fmt.decode(c, g.to(codes.device), torch.float32) for c, g in zip(parts, self.grids)], -2)


def e4m3_values(quotient: torch.Tensor) -> torch.Tensor:
    """fp32 values of the E4M3 codes nearest fp32 `quotient`: nearest-even, saturating at +-448,
    as the FP8 formats' encoders round (eprt.quant.numerics.to_e4m3); -0.0 and a negative value
    that rounds to zero keep their sign bit."""
    return to_e4m3(quotient).float()
