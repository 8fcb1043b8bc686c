"""The scales every quantized module is written with, resolved from the calibration state and
the weights: the one rule the preview, both export layouts and the checks follow.

- A per-tensor scale is amax / 448 (FP8) or amax / (6 * 448) (NVFP4's weight_scale_2).
- Linears the engines fuse (eprt.quant.fusion) share input amax and, under NVFP4, per-tensor
  weight amax.
- Gate and up of one routed expert (one row of w13) share one weight amax; down (w2) has its own.
- Every expert of a layer gets the layer's largest input amax per projection (w13, w2), also the
  experts no token reached, because the engines load one input scale per fused MoE.
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import torch

from eprt.quant.calibrated import CalibrationState
from eprt.quant.fp8 import fp8_scale
from eprt.quant.fusion import siblings
from eprt.quant.numerics import abs_amax
from eprt.quant.nvfp4 import nvfp4_scale

SCALE = {"fp8": fp8_scale, "nvfp4": nvfp4_scale}
EXPERT_KINDS = ("w13", "w2")  # the stacked projections of a routed-experts module


class Scales:
    """`formats`: each quantized module (dense Linear or experts module) -> its format;
    `weight(module)`: a dense Linear's weight, read when its scale is first asked for."""

    def __init__(self, formats: Mapping[str, str], state: CalibrationState, weight: Callable[[str], torch.Tensor]):
        self.formats, self.state, self.weight = formats, state, weight

    def scale(self, module: str, amax: torch.Tensor) -> torch.Tensor:
        return SCALE[self.formats[module]](amax)

    def group(self, module: str) -> list[str]:
        return siblings(module, self.formats, self.formats[module])

    @functools.lru_cache(maxsize=None)
    def weight_amax(self, module: str) -> torch.Tensor:
        return max(abs_amax(self.weight(m)) for m in self.group(module))

    def input_amax(self, module: str) -> torch.Tensor:
        return max(self.state.input_amax[m] for m in self.group(module))

    def weight_scale(self, module: str) -> torch.Tensor:
        """A dense Linear's per-tensor weight scale (NVFP4: weight_scale_2)."""
        return self.scale(module, self.weight_amax(module))

    def input_scale(self, module: str) -> torch.Tensor:
        return self.scale(module, self.input_amax(module))

    def expert_input_amax(self, module: str, kind: str) -> torch.Tensor:
        """The largest input amax of the experts held here (all of them at export; a rank's rows
        during calibration, which the preview reduces over the ranks)."""
        return self.state.expert_input_amax[module][EXPERT_KINDS.index(kind)].max()

    def expert_weight_scale(self, module: str, row: torch.Tensor) -> torch.Tensor:
        """One expert's per-tensor weight scale from its row of w13 (gate and up) or w2."""
        return self.scale(module, abs_amax(row))
