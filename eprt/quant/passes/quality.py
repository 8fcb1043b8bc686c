"""The quality report as a pass (eprt.quant.quality measures, this runs its streams): the
held-out sequences, as two streams, through each decoder layer once its statistics are final:
the reference stream through the layer as it is, the quantized stream through the layer
quantized as the export computes it, each quantized module probed against its original weights;
after the last layer, both streams through the final norm and the head. The multi-token-prediction
layers are not in the report."""

from __future__ import annotations

from eprt.parallel import ParallelState
from eprt.quant.engine import LayerEngine, LayerWork, Pass
from eprt.quant.quality import Probes, QualityReport
from eprt.quant.sequences import LayerState, Schedule, Sequences


class QualityStreams(Pass):
    covers_mtp = False

    def __init__(self, state: ParallelState, report: QualityReport, schedule: Schedule):
        self.report = report
        self.sequences = Sequences(state, schedule, report.ck.config.num_experts_per_tok)
        # both streams at a layer boundary (eprt.quant.workdir saves and restores them)
        self.ref: LayerState | None = None
        self.quant: LayerState | None = None
        self.probes: Probes | None = None  # the running layer's, from `reference` to `on_quantized`

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return self.sequences.pairs

    def begin(self, embed) -> None:
        held = embed(self.report.eval_ids[self.sequences.mine])
        self.ref, self.quant = LayerState(held, []), LayerState(held.clone(), [])

    def reference(self, layer: LayerWork) -> None:
        layer.run(self.sequences, self.ref)

    def quantize(self, layer: LayerWork) -> None:
        # the probes keep the original weights: made ahead of the passes that replace them (GPTQ's
        # solve, the quantized layer), once GPTQ's Hessians are summed (not both held during a run)
        self.probes = self.report.probes(layer.module, layer.prefix, self.sequences.schedule.num_groups)
        layer.on_weight = self.report.on_weight

    def on_quantized(self, layer: LayerWork) -> None:
        errors, schedule = self.probes.errors, self.sequences.schedule

        def at_step(step: int) -> None:  # the expert probes file each unit at its global index
            errors.first_unit = schedule.step_groups(step)[0]

        with self.probes.measuring():
            layer.run(self.sequences, self.quant, on_sequence=errors.enter, on_step=at_step)
        self.probes = None
        self.report.finish_layer(layer.index, layer.prefix, self.pairs, self.ref.hidden, self.quant.hidden, errors)

    def finish(self, engine: LayerEngine, ls: LayerState) -> None:
        with engine.head() as logits:
            self.report.finish(self.pairs, lambda li: (logits(self.ref, li), logits(self.quant, li)))
