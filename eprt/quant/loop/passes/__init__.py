"""The passes of the layer loop (eprt.quant.loop.engine), one algorithm each, and the one place that
lists a run's passes in the order their hooks run (docs/adding-an-algorithm.md)."""

from __future__ import annotations

from eprt.loading.resolved import ResolvedCheckpoint
from eprt.quant.algorithms.search.passes import FormatErrors
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import Pass
from eprt.quant.loop.passes.all_experts import statistics_passes
from eprt.quant.loop.passes.mtp import MTPLayers
from eprt.quant.loop.passes.quality import QualityStreams
from eprt.quant.loop.passes.quantized_layer import QuantizedLayer
from eprt.quant.recipe import Recipe


def layer_passes(
    cal: Calibrator,
    recipe: Recipe | None = None,
    rc: ResolvedCheckpoint | None = None,
    *,
    quality: QualityStreams | None = None,
    balances: list[Pass] = (),
    roundings: list[Pass] = (),
    format_errors: FormatErrors | None = None,
    statistics: bool = True,
) -> list[Pass]:
    """A run's passes: max statistics (with --calibrate-all-experts, every expert's too; not with
    `statistics` False, where `cal`'s are final already: the format search's); the format
    search's errors (`format_errors`, which restores the weights it quantizes); the quality report's
    streams (`quality`), the algorithms' passes that change weights before they are rounded
    (`balances`: AWQ's folds) and those that round them (`roundings`: GPTQ), which run through the
    layer quantized with `recipe` (the export's numerics, the source dtypes of `rc`); the MTP layers
    last. The algorithms' passes come from their program (eprt.quant.algorithms.program).

    The order is the hooks': the report's reference stream runs through the layer before a balance
    folds it, a rounding's statistics come from the folded layer, the report's probes keep the
    layer's weights before a rounding's solve replaces them, and the quantized layer is made after
    all of them. A balance pass says, with `measures_again()`, whether it measures the running
    layer's statistics again once folded: the statistics run's every-expert rows are then not needed."""
    passes: list[Pass] = statistics_passes(cal, lambda: any(b.measures_again() for b in balances)) if statistics else []
    passes += [format_errors] if format_errors is not None else []
    if quality is not None:
        passes.append(quality)
    passes += balances
    if quality is not None and balances:
        quality.measure_router_flips()
    passes += roundings
    if quality is not None or roundings:
        if recipe is None or rc is None:
            raise ValueError(
                "the quality report and a rounding run through the quantized layer: give its recipe and rc"
            )
        passes.append(QuantizedLayer(cal, recipe, rc, covers_mtp=bool(roundings)))
    passes.append(MTPLayers(cal.targets))
    return passes
