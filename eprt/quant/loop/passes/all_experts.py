"""--calibrate-all-experts as a pass: on each layer's statistics run, every token of a step also
runs through every routed expert of its layer, for the statistics only (the layer's output is the
routed one, untouched).

Each expert's rows are whole groups of sequences in (sequence, position) order, each group one
matmul on the rank that computes the expert's routed unit of that group
(eprt.parallel.dispatch.UnitDispatcher.every_expert_rows): the rows are a function of the data
alone, as the routed units' are. The rows go into the calibrator's amax
(`Calibrator.every_expert_observer`); a layer whose experts the recipe leaves unquantized is
skipped, on every rank alike.

`measure` is a statistics run of its own, as the layer loop's: AWQ measures its folded layer
again with it, so that with --calibrate-all-experts the experts' amax are those of the folded
experts over every token (their inputs x / s, their activations h / s); the layer loop's
statistics run then skips the every-expert rows of that layer, whose amax would be replaced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from eprt.models.moe import Experts
from eprt.models.taps import tapped
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerWork, Pass
from eprt.quant.loop.passes.max_statistics import MaxStatistics
from eprt.quant.loop.sequences import RoutedStep


class EveryExpertStatistics(Pass):
    def __init__(self, cal: Calibrator, measured_again: Callable[[], bool] = lambda: False):
        """`measured_again()`: whether a later pass measures the running layer's statistics again
        in place of these (AWQ, on a layer it folds), so that this run need not compute them."""
        self.cal, self.measured_again = cal, measured_again
        self.tapped: list[Experts] = []  # the layer's experts modules observed, during its statistics run

    @contextlib.contextmanager
    def observe(self, layer: LayerWork) -> Iterator[None]:
        with contextlib.ExitStack() as taps:
            for name in self.cal.targets:
                if not name.startswith(layer.prefix):
                    continue
                experts = layer.module.get_submodule(name[len(layer.prefix) :])
                if isinstance(experts, Experts):
                    taps.enter_context(tapped(experts, every_expert=self.cal.every_expert_observer(name, experts)))
                    self.tapped.append(experts)
            try:
                yield
            finally:
                self.tapped = []

    def on_routed(self, layer: LayerWork, routed: RoutedStep) -> None:
        if not any(routed.moe.experts is e for e in self.tapped) or self.measured_again():
            return
        run_every_expert(routed)


def run_every_expert(routed: RoutedStep) -> None:
    """A routed step's tokens through every expert of its layer, each expert's rows to its
    `every_expert` tap (none installed: nothing is computed). Every rank calls it for every step
    alike: the rows' exchange is collective."""
    x_sorted, rows_per_unit_U = routed.sequences.dispatcher.every_expert_rows(
        routed.x_TD, routed.key_T, routed.unit_T, routed.groups
    )
    routed.moe.experts.observe_every_expert(x_sorted, rows_per_unit_U)


def statistics_passes(cal: Calibrator, measured_again: Callable[[], bool] = lambda: False) -> list[Pass]:
    """The passes of a statistics run into `cal`: max statistics, and with --calibrate-all-experts
    (`cal.all_experts`) every expert's, after them (their amax are the same tensors), skipped on a
    layer whose statistics are `measured_again()`."""
    return [MaxStatistics(cal), *([EveryExpertStatistics(cal, measured_again)] if cal.all_experts else [])]


def measure(layer: LayerWork, cal: Calibrator, *, write: bool) -> None:
    """The calibration sequences through `layer` as it is now, its statistics into `cal` as the
    layer loop's statistics run records them (made final over the ranks); with `write`, their
    outputs replace the hidden states."""
    passes = statistics_passes(cal)

    def on_routed(routed: RoutedStep) -> None:
        for p in passes:
            p.on_routed(layer, routed)

    with contextlib.ExitStack() as taps:
        for p in passes:
            taps.enter_context(p.observe(layer))
        layer.run_calibration(write=write, on_routed=on_routed)
