"""The quality report as a pass (eprt.quant.quality measures, this runs its streams): the
held-out sequences, as two streams, through each decoder layer once its statistics are final:
the reference stream through the layer as it is, the quantized stream through the layer
quantized as the export computes it, each quantized module probed against its original weights;
after the last layer, both streams through the final norm and the head. The multi-token-prediction
layers are not in the report.

With AWQ, the reference stream runs through each MoE layer a second time once AWQ has folded it
(unquantized): the share of the routers' top-k choices that the folds alone change (their
roundings, and a bf16 router's near ties) goes into the report."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from eprt.parallel import ParallelState
from eprt.quant.loop.engine import LayerEngine, LayerWork, Pass
from eprt.quant.loop.sequences import LayerState, Schedule, Sequences
from eprt.quant.quality import Probes, QualityReport


@contextlib.contextmanager
def routed_choices(layer: nn.Module) -> Iterator[tuple[Callable[[int], None], dict[int, torch.Tensor]]]:
    """(an `on_sequence` for a run of `layer`, what it fills: each local sequence's top-k expert
    ids [T, K]). A sequence's dense part, the router's call with it, runs whole on one thread."""
    running, choices = threading.local(), {}

    def chose(_m, _args, out) -> None:
        choices[running.sequence] = out[0]

    def on_sequence(local: int) -> None:
        running.sequence = local

    hook = layer.routed.gate.register_forward_hook(chose)
    try:
        yield on_sequence, choices
    finally:
        hook.remove()


def changed_choices(before: dict[int, torch.Tensor], after: dict[int, torch.Tensor]) -> torch.Tensor:
    """int64 [2]: the top-k choices of `before` not among `after`'s for the same token, and all choices."""
    changed = total = 0
    for li, a in before.items():
        kept = (a.unsqueeze(-1) == after[li].unsqueeze(-2)).any(-1)
        changed, total = changed + int((~kept).sum()), total + a.numel()
    return torch.tensor([changed, total], dtype=torch.int64)


class QualityStreams(Pass):
    covers_mtp = False

    def __init__(self, state: ParallelState, report: QualityReport, schedule: Schedule):
        self.report = report
        self.sequences = Sequences(state, schedule, report.ck.config.num_experts_per_tok)
        # both streams at a layer boundary (eprt.quant.run.workdir saves and restores them)
        self.ref: LayerState | None = None
        self.quant: LayerState | None = None
        self.probes: Probes | None = None  # the running layer's, from `reference` to `on_quantized`
        self.flips = False  # with AWQ: each MoE layer's router choices, before its folds and after
        self.before: tuple[LayerState, dict[int, torch.Tensor]] | None = None  # the layer's input and choices
        self.changed: torch.Tensor | None = None  # the layer's changed choices and all, over the ranks

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return self.sequences.pairs

    def begin(self, embed) -> None:
        held = embed(self.report.eval_ids[self.sequences.mine])
        self.ref, self.quant = held, held.copy()

    def measure_router_flips(self) -> None:
        """Count the router choices AWQ's folds change (the run folds each layer after `reference`)."""
        self.flips = True

    def reference(self, layer: LayerWork) -> None:
        if not (self.flips and layer.module.routed is not None):
            layer.run(self.sequences, self.ref)
            return
        held = self.ref.copy()
        with routed_choices(layer.module) as (on_sequence, choices):
            layer.run(self.sequences, self.ref, on_sequence=on_sequence)
        self.before = (held, choices)

    def _count_flips(self, layer: LayerWork) -> None:
        """The held-out sequences through the folded, unquantized layer: how many choices moved."""
        held, before = self.before
        self.before = None
        with routed_choices(layer.module) as (on_sequence, after):
            layer.run(self.sequences, held, write=False, on_sequence=on_sequence)
        changed = changed_choices(before, after).to(layer.state.device)
        self.changed = layer.state.all_reduce(changed, over="dp", op=dist.ReduceOp.SUM)

    def quantize(self, layer: LayerWork) -> None:
        if self.before is not None:
            self._count_flips(layer)
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
        self.probes, changed, self.changed = None, self.changed, None
        self.report.finish_layer(
            layer.index, layer.prefix, self.pairs, self.ref.hidden, self.quant.hidden, errors, changed
        )

    def finish(self, engine: LayerEngine, ls: LayerState) -> None:
        with engine.head() as logits:
            self.report.finish(self.pairs, lambda li: (logits(self.ref, li), logits(self.quant, li)))
