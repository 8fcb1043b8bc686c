"""Max calibration as a pass: the abs-max of every quantized module's input and of the KV cache
(eprt.quant.loop.calibrate.Calibrator), recorded on each layer's statistics run."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerWork, Pass


class MaxStatistics(Pass):
    def __init__(self, cal: Calibrator):
        self.cal = cal

    @contextlib.contextmanager
    def observe(self, layer: LayerWork) -> Iterator[None]:
        """The layer's observers for the run; then its amax made final over the ranks (the
        quantized layer's scales are the export's). Max is exact and idempotent: the run's final
        reduction changes them no further."""
        with self.cal.observing(layer.module, layer.prefix):
            yield
        self.cal.reduce_amax(layer.state, layer.prefix)
