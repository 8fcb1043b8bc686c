"""The passes of the layer loop (eprt.quant.engine), one algorithm each, and the one place that
lists a run's passes in the order their hooks run (docs/adding-an-algorithm.md)."""

from __future__ import annotations

from eprt.models.resolved import ResolvedCheckpoint
from eprt.quant.calibrate import Calibrator
from eprt.quant.engine import Pass
from eprt.quant.gptq_layer import GPTQRun
from eprt.quant.passes.all_experts import statistics_passes
from eprt.quant.passes.auto_quantize import FormatErrors
from eprt.quant.passes.awq import AWQ
from eprt.quant.passes.gptq import GPTQ
from eprt.quant.passes.mtp import MTPLayers
from eprt.quant.passes.quality import QualityStreams
from eprt.quant.passes.quantized_layer import QuantizedLayer
from eprt.quant.recipe import Recipe


def layer_passes(
    cal: Calibrator,
    recipe: Recipe | None = None,
    rc: ResolvedCheckpoint | None = None,
    *,
    quality: QualityStreams | None = None,
    awq: AWQ | None = None,
    gptq: GPTQRun | None = None,
    format_errors: FormatErrors | None = None,
    statistics: bool = True,
) -> list[Pass]:
    """A run's passes: max statistics (with --calibrate-all-experts, every expert's too; not with
    `statistics` False, where `cal`'s are final already: the format search's); the format
    search's errors (`format_errors`, which restores the weights it quantizes); the quality report's
    streams (`quality`), AWQ's folds (`awq`) and GPTQ (`gptq`), which run through the layer quantized
    with `recipe` (the export's numerics, the source dtypes of `rc`); the MTP layers last.

    The order is the hooks': the report's reference stream runs through the layer before AWQ folds
    it, GPTQ's Hessians come from the folded layer, the report's probes keep the layer's weights
    before GPTQ's solve replaces them, and the quantized layer is made after all of them."""
    # AWQ measures the layers it folds again, every expert's rows with them: the statistics run's are not needed there
    measured_again = awq.measures_again if awq is not None else lambda: False
    passes: list[Pass] = statistics_passes(cal, measured_again) if statistics else []
    passes += [format_errors] if format_errors is not None else []
    if quality is not None:
        passes.append(quality)
    if awq is not None:
        passes.append(awq)
        if quality is not None:
            quality.measure_router_flips()
    if gptq is not None:
        passes.append(GPTQ(gptq, cal))
    if quality is not None or gptq is not None:
        if recipe is None or rc is None:
            raise ValueError("the quality report and GPTQ run through the quantized layer: give its recipe and rc")
        passes.append(QuantizedLayer(cal, recipe, rc, covers_mtp=gptq is not None))
    passes.append(MTPLayers(cal.targets))
    return passes
