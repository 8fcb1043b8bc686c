"""The format search's measurements as a pass (eprt.quant.algorithms.search.auto_quantize chooses from them): the
calibration sequences through each decoder layer once its statistics are final, as it is (the
stream's next input), then once per (module group, candidate format) with that group alone
fake-quantized in that format with the export's scales; each run's squared error of the layer's
output against the layer as it is, per calibration token, over the RMS of the output's tokens
(eprt.quant.algorithms.search.auto_quantize says why). The calibration sequences, not the quality report's held-out
ones: the report's KL of the chosen recipe is then measured on data the choice was not fitted to.

The pass keeps its own copy of the calibration stream, the layer's input: the engine's hidden
states hold the layer's output by the time the statistics are final.

The errors are summed per sequence in fp64 and filed at its global index before the sum over the
ranks (eprt.quant.quality.filed_over_ranks), so the choice is the same at every layout."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from eprt.layout import layer_of
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.models.moe import Experts
from eprt.parallel import ParallelState
from eprt.quant.algorithms.search.auto_quantize import Group, SearchSpace
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerWork, Pass
from eprt.quant.loop.sequences import LayerState, Schedule, Sequences
from eprt.quant.preview import fake_quantize
from eprt.quant.quality import filed_over_ranks
from eprt.quant.recipe import Recipe, Rule


class FormatErrors(Pass):
    covers_mtp = False

    def __init__(
        self,
        state: ParallelState,
        cal: Calibrator,
        rc: ResolvedCheckpoint,
        space: SearchSpace,
        samples: torch.Tensor,
        schedule: Schedule,
        algorithm: str,
    ):
        """`samples`: the calibration sequences [n, T], `schedule` their steps (the engine's)."""
        self.cal, self.rc, self.space, self.samples, self.algorithm = cal, rc, space, samples, algorithm
        self.sequences = Sequences(state, schedule, rc.ck.config.num_experts_per_tok)
        self.layers: dict[int, list[Group]] = {}
        for g in space.groups:
            self.layers.setdefault(layer_of(g.modules[0]), []).append(g)
        self.stream: LayerState | None = None  # the calibration sequences at the running layer's input
        self.errors: dict[tuple[str, str], float] = {}  # (group, format) -> the error above

    def _quantized(self, g: Group) -> list[str]:
        return [c for c in self.space.candidates if c in g.bits and c != "none"]

    def own_steps(self) -> int:
        runs = max((sum(len(self._quantized(g)) for g in gs) for gs in self.layers.values()), default=0)
        return (1 + runs) * self.sequences.schedule.num_steps

    def begin(self, embed) -> None:
        self.stream = embed(self.samples[self.sequences.mine])

    def _through(self, layer: LayerWork) -> LayerState:
        """The stream through the layer as it stands now, into a copy."""
        out = self.stream.copy()
        layer.run(self.sequences, out, tick=layer.count_step)
        return out

    def _summed(self, layer: LayerWork, per_sequence: torch.Tensor) -> float:
        n = self.sequences.schedule.num_sequences
        return filed_over_ranks(layer.state, n, self.sequences.pairs, per_sequence).sum().item()

    def reference(self, layer: LayerWork) -> None:
        ref = self._through(layer)
        local = [li for _, li in self.sequences.pairs]
        y_ref = ref.hidden[local].double()
        tokens = self.samples.numel()
        rms = (self._summed(layer, y_ref.square().flatten(1).sum(1)) / tokens) ** 0.5  # of the output's tokens
        for g in self.layers.get(layer.index, []):
            for fmt in self._quantized(g):
                with self._alone(layer, g, fmt):
                    y = self._through(layer).hidden[local].double()
                self.errors[(g.name, fmt)] = self._summed(layer, (y - y_ref).square().flatten(1).sum(1)) / tokens / rms
        self.stream = ref

    @contextlib.contextmanager
    def _alone(self, layer: LayerWork, g: Group, fmt: str) -> Iterator[None]:
        """The layer with group `g` alone fake-quantized in `fmt`; its weights restored after."""
        tensors = []
        for m in g.modules:
            module = layer.module.get_submodule(m[len(layer.prefix) :])
            tensors += list(module.projections().values()) if isinstance(module, Experts) else [module.weight]
        saved = [t.detach().clone() for t in tensors]
        probe = Recipe(f"{fmt} probe", (Rule("*", fmt, self.algorithm),), None)
        undo = fake_quantize(
            layer.module,
            list(g.modules),
            probe,
            self.cal,
            layer.state,
            prefix=layer.prefix,
            source_dtype=self.rc.source_dtype,
        )
        try:
            yield
        finally:
            undo()
            with torch.no_grad():
                for t, s in zip(tensors, saved):
                    t.copy_(s)
