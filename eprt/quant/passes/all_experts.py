"""--calibrate-all-experts as a pass: on each layer's statistics run, every token of a step also
runs through every routed expert of its layer, for the statistics only (the layer's output is the
routed one, untouched).

Each expert's rows are whole groups of sequences in (sequence, position) order, each group one
matmul on the rank that computes the expert's routed unit of that group
(eprt.parallel.dispatch.UnitDispatcher.every_expert_rows): the rows are a function of the data
alone, as the routed units' are. The rows go into the calibrator's amax
(`Calibrator.every_expert_observer`); a layer whose experts the recipe leaves unquantized is
skipped, on every rank alike.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from eprt.models.moe import Experts
from eprt.models.taps import tapped
from eprt.quant.calibrate import Calibrator
from eprt.quant.engine import LayerWork, Pass
from eprt.quant.sequences import RoutedStep


class EveryExpertStatistics(Pass):
    def __init__(self, cal: Calibrator):
        self.cal = cal
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
        experts = routed.moe.experts
        if not any(experts is e for e in self.tapped):
            return
        x_sorted, rows_per_unit_U = routed.sequences.dispatcher.every_expert_rows(
            routed.x_TD, routed.key_T, routed.unit_T, routed.groups
        )
        experts.observe_every_expert(x_sorted, rows_per_unit_U)
