"""The algorithms that take the statistics run's amax alone: `max` (a weight's scale from its amax)
and `mse` (its format's search for the scale of least squared error, at export: eprt.quant.scales).
Neither adds a pass, a memory term, a resume state or a record: their life is the default's."""

from __future__ import annotations

from eprt.quant.algorithms.base import Algorithm


class Max(Algorithm):
    name = "max"


class MSE(Algorithm):
    name = "mse"
