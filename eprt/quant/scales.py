"""The scales every quantized module is written with, resolved from the calibration record and
the weights: the one rule the preview, both export layouts and the checks follow.

- A per-tensor scale is amax / 448 (FP8) or amax / (6 * 448) (NVFP4's weight_scale_2).
- Linears the engines fuse (eprt.quant.fusion) share input amax and, under NVFP4, per-tensor
  weight amax.
- Gate and up of one routed expert (one row of its first stacked projection) share one weight
  amax; down has its own.
- Every expert of a layer gets the layer's largest input amax per stacked projection, also the
  experts no token reached, because the engines load one input scale per fused MoE.
- Under a module's `mse` algorithm, its format searches the scales it searches (FP8 the
  per-tensor weight scale, NVFP4 and the block-scaled formats the block scales:
  eprt.quant.formats); NVFP4's weight_scale_2 stays the one above (fused siblings and gate/up
  keep sharing it).
"""

from __future__ import annotations

import functools
from typing import Callable, Mapping

import torch

from eprt.layout import EXPERT_LEAVES
from eprt.quant.calibrated import CalibrationRecord
from eprt.quant.formats import WeightFormat, weight_format
from eprt.quant.fusion import siblings
from eprt.quant.numerics import abs_amax
from eprt.storage.checkpoint import Checkpoint

# the weights a routed expert's row of each stacked projection holds end to end (gate and up, or one)
EXPERT_PIECES = {leaf: fan for leaf, (_, fan) in EXPERT_LEAVES.items()}


class Scales:
    """`formats`: each quantized module (dense Linear or experts module) -> its format;
    `weight(module)`: a dense Linear's weight as it is quantized, read when its scale is first
    asked for; `algorithms`: each quantized module -> its algorithm (eprt.quant.recipe.ALGORITHMS;
    `max` where it names none); `headroom`: the recipe's scale_headroom (the mse weights' per-tensor
    scale with the format's headroom, where it has one)."""

    def __init__(
        self,
        formats: Mapping[str, str],
        record: CalibrationRecord,
        weight: Callable[[str], torch.Tensor],
        algorithms: Mapping[str, str] | None = None,
        headroom: bool = False,
    ):
        self.formats, self.record, self.weight = formats, record, weight
        self.algorithms, self.headroom = algorithms or {}, headroom

    @classmethod
    def of_checkpoint(
        cls,
        ck: Checkpoint,
        formats: Mapping[str, str],
        record: CalibrationRecord,
        algorithms: Mapping[str, str] | None = None,
        headroom: bool = False,
    ) -> "Scales":
        """The export's scales: over `record`, from the original weights of `ck` as they are quantized."""
        weight = lambda m: as_quantized(ck, f"{m}.weight", formats[m], ck.read(f"{m}.weight"))  # noqa: E731
        return cls(formats, record, weight, algorithms, headroom)

    def format(self, module: str) -> WeightFormat:
        return weight_format(self.formats[module])

    def searched(self, module: str) -> bool:
        """Whether `module`'s weight scales come from the mse search."""
        return self.algorithms.get(module, "max") == "mse"

    def scale(self, module: str, amax: torch.Tensor) -> torch.Tensor:
        return self.format(module).scale(amax)

    def group(self, module: str) -> list[str]:
        return siblings(module, self.formats, self.format(module))

    @functools.lru_cache(maxsize=None)
    def weight_amax(self, module: str) -> torch.Tensor:
        return max(abs_amax(self.weight(m)) for m in self.group(module))

    def input_amax(self, module: str) -> torch.Tensor:
        return max(self.record.input_amax[m] for m in self.group(module))

    @functools.lru_cache(maxsize=None)
    def weight_scale(self, module: str) -> torch.Tensor:
        """A dense Linear's per-tensor weight scale (NVFP4: weight_scale_2)."""
        return self._weight_scale(module, self.weight_amax(module), lambda: self.weight(module))

    def input_scale(self, module: str) -> torch.Tensor:
        return self.scale(module, self.input_amax(module))

    def engine_input_scale(self, module: str) -> torch.Tensor | None:
        """The input scale a dense Linear's inputs are quantized under by the engine: the format's
        pinned one, the calibrated one, or None for a format that has none (inputs the engine scales
        at run time or leaves in bf16: a data-free recipe's record holds no input amax to read)."""
        fmt = self.format(module)
        if fmt.pinned_input_scale() is not None:
            return fmt.pinned_input_scale()
        return self.input_scale(module) if fmt.uses_activation_statistics else None

    def expert_input_amax(self, module: str, kind: str) -> torch.Tensor:
        """The largest input amax of the experts held here (all of them at export; a rank's rows
        during calibration, which the preview reduces over the ranks)."""
        return self.record.expert_input_amax[module][EXPERT_LEAVES[kind][0]].max()

    def expert_weight_scale(self, module: str, row: torch.Tensor) -> torch.Tensor:
        """One expert's per-tensor weight scale from its row of a stacked projection (gate and up, or one), as it is
        quantized: the scale its format keeps the row's values exactly under where it has one (an
        MXFP4 source's experts in NVFP4), else the amax rule's."""
        exact = self.format(module).exact_weight_scale(row)
        return exact if exact is not None else self._weight_scale(module, abs_amax(row), lambda: row)

    def _weight_scale(self, module: str, amax: torch.Tensor, weight: Callable[[], torch.Tensor]) -> torch.Tensor:
        """The per-tensor scale of `amax`, or under mse the format's search over the weight (read only then)."""
        fmt = self.format(module)
        if not self.searched(module):
            return fmt.scale(amax)
        roomy = fmt.headroom_scale(amax) if self.headroom else None
        return roomy if roomy is not None else fmt.mse_weight_scale(weight(), amax)

    def quantize_weight(self, module: str, w: torch.Tensor, w_scale: torch.Tensor) -> dict[str, torch.Tensor]:
        """The export tensors (by ModelOpt leaf) of `w`, a weight of `module` as it is quantized
        (`as_quantized`), under per-tensor `w_scale`."""
        return self.format(module).quantize(w, w_scale, self.searched(module))

    def fake_quantize_weight(
        self, module: str, w: torch.Tensor, w_scale: torch.Tensor, dtype: torch.dtype, pieces: int = 1
    ) -> torch.Tensor:
        """The weight an engine computes with (`dequantize_weight` of `quantize_weight`'s
        tensors) in `dtype`; w's rows hold `pieces` weights end to end (`EXPERT_PIECES`), each in
        blocks of its own where the format's blocks span rows, as the export quantizes them."""
        fmt, mse = self.format(module), self.searched(module)
        if fmt.blocks_span_rows and pieces > 1:
            return fmt.dequantize_stacked(fmt.quantize_stacked(w, w_scale, mse, pieces), dtype, pieces)
        return fmt.fake_quantize_weight(w, w_scale, mse, dtype)


def as_quantized(ck: Checkpoint, name: str, fmt: str, w: torch.Tensor) -> torch.Tensor:
    """Weight `name` of `ck` as format `fmt` quantizes it: one that rounds the quotient to the
    weight's dtype first (FP8) gets the source's dtype, as the source is held when loaded as it is,
    whatever dtype eprt converted it to. A multi-token-prediction layer's stacked experts, which
    convert carries through under their Hugging Face names, are named by a source tensor of theirs
    (eprt.loading.resolved.ResolvedCheckpoint.source_dtype)."""
    return w.to(ck.meta(name).source_dtype) if weight_format(fmt).rounds_in_weight_dtype else w


def dequantize_weight(fmt: str, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The weight an engine computes with, from its export tensors (`Scales.quantize_weight`'s)."""
    return weight_format(fmt).dequantize(t, dtype)
