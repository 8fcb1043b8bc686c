"""AWQ as a registered algorithm: its memory (eprt.quant.algorithms.awq.plan: samples, searches, folds), the
checkpoint view its folds leave (eprt.quant.algorithms.awq.folds.FoldedCheckpoint, read by the run's later
layers, by the preview and by the export), its state (the folds, saved at each layer boundary and
recorded in the calibrated checkpoint) and its pass (eprt.quant.algorithms.awq.passes)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch
from torch import nn

from eprt.loading.resolved import ResolvedCheckpoint, place_tensors
from eprt.quant.algorithms.awq.folds import FoldedCheckpoint, Folds
from eprt.quant.algorithms.awq.passes import AWQ, NAME
from eprt.quant.algorithms.awq.plan import AWQMemory
from eprt.quant.algorithms.base import Algorithm, RunContext
from eprt.quant.loop.engine import Pass


class AWQAlgorithm(Algorithm):
    name = NAME
    measures_again = True

    def memory(self, rc, model, targets, modules: Mapping[str, str], device, params) -> AWQMemory:
        return AWQMemory.of(rc, model, targets, modules, on_cpu=torch.device(device).type == "cpu")

    def view(self, rc: ResolvedCheckpoint, first_expert: int) -> tuple[ResolvedCheckpoint, Folds]:
        """The run reads its layers through the folds (the routed experts' clips: this rank's rows,
        from `first_expert`)."""
        folds = Folds(first_expert)
        return dataclasses.replace(rc, ck=FoldedCheckpoint(rc.ck, folds)), folds

    def passes(self, ctx: RunContext, folds: Folds, rounds_after: bool) -> list[Pass]:
        # the folded layer's run makes the calibration sequences' output unless a rounding's run does
        return [AWQ(ctx.cal, ctx.recipe, folds, writes=not rounds_after)]

    def saved(self, folds: Folds) -> dict[str, torch.Tensor]:
        return folds.tensors()

    def restore(self, folds: Folds, tensors: dict[str, torch.Tensor]) -> None:
        folds.load(tensors)

    def record(self, folds: Folds) -> Folds:
        return folds

    def apply(self, folds: Folds, model: nn.Module, rc: ResolvedCheckpoint, experts, device) -> set[str]:
        """The folded tensors read into `model` again through the run's view (`rc`); the fake
        quantization then quantizes them as any weight."""
        place_tensors(rc.holding(experts), model, folds.tensor_names(), device=device)
        return set()
