"""The layer quantized in place as the export computes it, for the passes that run through it
(the quality report's quantized stream, GPTQ's next input): eprt.quant.preview.fake_quantize with
the layer's final amax, the weights a pass already set (`LayerWork.exported`) left as they are."""

from __future__ import annotations

from eprt.loading.resolved import ResolvedCheckpoint
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerWork, Pass
from eprt.quant.preview import fake_quantize
from eprt.quant.recipe import Recipe


class QuantizedLayer(Pass):
    def __init__(self, cal: Calibrator, recipe: Recipe, rc: ResolvedCheckpoint, *, covers_mtp: bool):
        self.cal, self.recipe, self.rc = cal, recipe, rc
        self.covers_mtp = covers_mtp

    def quantize(self, layer: LayerWork) -> None:
        undo = fake_quantize(
            layer.module,
            self.cal.targets,
            self.recipe,
            self.cal,
            layer.state,
            prefix=layer.prefix,
            source_dtype=self.rc.source_dtype,
            on_weight=layer.on_weight,
            quantized=layer.exported,
        )
        layer.kept.callback(undo)  # its hooks and taps until the layer is done (the weights stay replaced)
