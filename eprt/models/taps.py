"""Where quantization may reach into the model: one typed set of taps per module kind.

A module kind that quantization observes or changes holds one taps object as `module.taps`, every
field None until `tapped` sets it for a while; the module calls a tap where it is set and computes
as if it were not there otherwise. Nothing else of a model is set from outside:

- `ExpertsTaps` on `eprt.models.moe.Experts` (routed experts): the inputs of both projections of
  the routed rows (calibration's amax), each (expert, work unit)'s rows (GPTQ's Hessians), the
  statistics-only rows of --calibrate-all-experts, each work unit's output (the quality report's
  error), and the gate/up input and the down input (the gated activation) replaced by their
  fake quantization.
- `KVTaps` on the attentions with a KV cache (`eprt.models.attention.GQAttention`,
  `eprt.models.mla.MLAttention`): the keys and values as attention consumes them, observed
  (KV-cache calibration) and replaced (the FP8 KV cache's quantize-dequantize).

Dense Linears need no taps: torch's forward hooks see and replace their inputs.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

Tensor = torch.Tensor


@dataclass
class ExpertsTaps:
    # routed(x_sorted, h_sorted, tokens_per_expert): both projections' inputs of the routed rows,
    # sorted by local expert (h: the gated activation the down projection reads)
    routed: Callable[[Tensor, Tensor, Tensor], None] | None = None
    # units(x_sorted, h_sorted, rows_per_unit_LU): the same rows as `Experts.forward_units` cut them,
    # by (local expert, work unit)
    units: Callable[[Tensor, Tensor, Tensor], None] | None = None
    # every_expert(local expert, x_rows, h_rows, rows_per_unit_U): statistics-only rows
    # (`Experts.observe_every_expert`), sorted by work unit, with each unit's row count
    every_expert: Callable[[int, Tensor, Tensor, Tensor], None] | None = None
    # units_output(x_sorted, rows_per_unit_LU, y_sorted): each work unit's output, beside its rows as
    # received (before `input`)
    units_output: Callable[[Tensor, Tensor, Tensor], None] | None = None
    # input(x_sorted) -> what gate/up read, in both forwards alike (a pre-hook would miss forward_units)
    input: Callable[[Tensor], Tensor] | None = None
    # activation(h) -> what the down projection reads, where the gated activation is made
    activation: Callable[[Tensor], Tensor] | None = None


@dataclass
class KVTaps:
    # observe(k, v): the keys and values as attention consumes them
    observe: Callable[[Tensor, Tensor], None] | None = None
    # replace(k, v) -> (k, v): what attention consumes instead, after `observe` saw them
    replace: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None


class tapped(contextlib.AbstractContextManager):  # lower case, as contextlib.suppress: read as `with tapped(...)`
    """Set `taps` (field=callable) on `module.taps` from entering the context to leaving it. A tap
    already set is refused: two callers would otherwise each believe theirs is the one called.
    A class, not a generator: a context entered and never left (the preview's fake quantization
    of the whole model) keeps its taps, where a collected generator would clear them."""

    def __init__(self, module: nn.Module, **taps: Callable):
        held = getattr(module, "taps", None)
        if held is None:
            raise TypeError(f"{type(module).__name__} declares no taps (eprt.models.taps)")
        fields = {f.name for f in dataclasses.fields(held)}
        for name in taps:
            if name not in fields:
                raise TypeError(f"{type(held).__name__} has no tap {name!r}; it has {sorted(fields)}")
        self.module, self.held, self.taps = module, held, taps

    def __enter__(self) -> None:
        for name in self.taps:
            if getattr(self.held, name) is not None:
                raise RuntimeError(f"{type(self.held).__name__}.{name} of {type(self.module).__name__} is already set")
        for name, fn in self.taps.items():
            setattr(self.held, name, fn)

    def __exit__(self, *_) -> None:
        for name in self.taps:
            setattr(self.held, name, None)
