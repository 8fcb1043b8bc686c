"""The `mse` weight scales (docs/export.md, 'Weight scales'): each weight scale chosen from a
fixed grid of candidates to minimize the weight's squared quantization error, computed with the
export's own numerics (eprt.quant.fp8, eprt.quant.nvfp4), so what is minimized is the error of
the bytes written. The weights alone decide: no calibration data is involved.

- FP8 per-tensor: weight_scale = fp8_scale(amax * c), c in ModelOpt's MSE multipliers
  (`MseCalibrator`: 0.25 to 4.0, 39 steps) with 1.0, max's own candidate, put first.
- NVFP4: weight_scale_2 stays max's (the per-tensor amax, shared as max shares it); each 16-element
  block picks its block scale among every positive finite E4M3 value (ModelOpt's FP8 scale sweep,
  `NVFP4MSECalibrator`), which includes max's own choice.

Both candidate lists are ascending after max's own, and a tie keeps the first candidate (argmin's
rule), so mse's error is never above max's. Errors are summed in float64: the comparison is then
exact to the last bit the quantized values can tell apart.
"""

from __future__ import annotations

import math

import torch

from eprt.quant.fp8 import dequantize_fp8, fp8_scale, quantize_fp8
from eprt.quant.nvfp4 import BLOCK_SIZE, dequantize_nvfp4, quantize_nvfp4

# ModelOpt's MseCalibrator defaults: start 0.25, stop 4.0, step 0.1 -> ceil(37.5) + 1 = 39 candidates.
FP8_MULTIPLIERS = torch.cat([torch.ones(1), torch.linspace(0.25, 4.0, steps=math.ceil((4.0 - 0.25) / 0.1) + 1)])
# Every positive finite E4M3 value, ascending: the bit patterns 1..126 (127 is NaN).
BLOCK_SCALES = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)
# Weight elements per step of the NVFP4 search, which quantizes them once per candidate in one
# call: bounds its working memory (a few float64 copies of 126 x this), not its result.
CHUNK_ELEMENTS = 1 << 13


def fp8_mse_scale(w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The FP8 weight_scale of least squared error for w (as quantize_fp8 takes it) among
    fp8_scale(amax * c), c in FP8_MULTIPLIERS; `amax`: w's abs-max (fp32)."""
    x = w.double()
    best, best_err = None, math.inf
    for c in FP8_MULTIPLIERS:
        scale = fp8_scale(amax * c)
        err = (x - dequantize_fp8(quantize_fp8(w, scale), scale).double()).square_().sum().item()
        if err < best_err:
            best, best_err = scale, err
    return best


def nvfp4_mse_block_scale(w: torch.Tensor, scale_2) -> torch.Tensor:
    """float8_e4m3fn block scales [..., in/16] of least squared error for w [..., in] under
    weight_scale_2 `scale_2`: each block's own choice among BLOCK_SCALES. Rows are independent,
    so they are searched a chunk of rows at a time, every candidate in one quantize call."""
    rows = w.reshape(-1, w.shape[-1])
    blocks = rows.shape[-1] // BLOCK_SIZE
    out = torch.empty(rows.shape[0], blocks, dtype=torch.float8_e4m3fn, device=w.device)
    step = max(1, CHUNK_ELEMENTS // rows.shape[-1])
    candidates = BLOCK_SCALES.to(w.device)
    for first in range(0, rows.shape[0], step):
        chunk = rows[first:first + step]
        scale = candidates.view(-1, 1, 1).expand(candidates.numel(), chunk.shape[0], blocks)
        xq = dequantize_nvfp4(quantize_nvfp4(chunk.expand(candidates.numel(), *chunk.shape), scale_2, scale)[0],
                              scale, scale_2)
        x = chunk.double().reshape(1, chunk.shape[0], blocks, BLOCK_SIZE)
        err = (xq.double().reshape(-1, chunk.shape[0], blocks, BLOCK_SIZE) - x).square_().sum(-1)
        out[first:first + step] = candidates[err.argmin(dim=0)]  # argmin: the first of equal errors
    return out.reshape(*w.shape[:-1], blocks)
