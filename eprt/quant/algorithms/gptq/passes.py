"""GPTQ as a pass (eprt.quant.algorithms.gptq.layer): on each layer, once its amax are final, a Hessian run of
the calibration sequences through the layer as it is, then the solve, whose weights the layer
takes; the calibration sequences' output is then made by a run through the quantized layer."""

from __future__ import annotations

from eprt.quant.algorithms.gptq.layer import GPTQRun, LayerGPTQ
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerWork, Pass
from eprt.quant.loop.passes.all_experts import run_every_expert


class GPTQ(Pass):
    rewrites = True
    calibration_runs = 2  # the Hessians' and the quantized one

    def __init__(self, run: GPTQRun, cal: Calibrator):
        self.run, self.cal = run, cal
        self.layer: LayerGPTQ | None = None  # the running layer's, from `reference` to `on_quantized`

    def reference(self, layer: LayerWork) -> None:
        self.layer = LayerGPTQ(self.run, layer.module, layer.prefix, self.cal)
        if self.layer.needs_hessians:
            # --calibrate-all-experts: every token through every expert GPTQ solves, into its sums
            every = self.layer.all_experts and self.layer.gptq_experts
            with self.layer.observing():
                layer.run_calibration(write=False, **({"on_routed": run_every_expert} if every else {}))

    def quantize(self, layer: LayerWork) -> None:
        self.layer.quantize()
        self.layer.free()
        layer.exported |= self.layer.modules

    def on_quantized(self, layer: LayerWork) -> None:
        layer.run_calibration(write=True)
        self.layer = None
