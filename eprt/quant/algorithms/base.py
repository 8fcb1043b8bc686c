"""What a calibration algorithm supplies, from the plan to the output (docs/adding-an-algorithm.md).

A run asks each algorithm its recipe runs, in the registry's order (balances before roundings):
- `memory(rc, model, targets, modules, device)`: what it holds of its own in a run, for the memory plan
  (eprt.quant.run.memory_plan.AlgorithmMemory);
- `view(rc, first_expert)`: the checkpoint as the run reads it after the algorithm changed weights
  (AWQ's folds), and its state that the view reads through; the plain checkpoint where it changes none;
- `start(ctx)`: its state in a run (what it decided so far), None where it keeps none;
- `passes(ctx, state, rounds_after)`: its passes of the layer loop (eprt.quant.loop.engine.Pass), which the
  probe of the time estimate runs as the run does, so the estimate has its time terms;
- `saved(state)` and `restore(state, tensors)`: what a layer boundary saves for --resume, in the
  work dir's `NAME-LAYER.safetensors` (eprt.quant.run.workdir), and gives back;
- `record(state)`: its part of the calibrated checkpoint's record (eprt.quant.calibrated.RecordPart, whose
  class the registry names, so that the export reads it back);
- `apply(state, model, rc, experts)`: what it decided, set into a whole model (the preview's);
- `summary(state, ctx)`: what it adds to the calibration summary (with, where the registry's entry names
  them, the quality report's per-expert lists: eprt.quant.algorithms.registry.Entry.expert_notes).
Refusals belong where the recipe is checked against the model (eprt.quant.feasibility) and to its
typed parameters (eprt.quant.algorithms.registry)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.calibrated import RecordPart
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import Pass
from eprt.quant.recipe import Recipe
from eprt.quant.run.memory_plan import AlgorithmMemory


@dataclass(frozen=True)
class RunContext:
    """What an algorithm's state and passes are built from."""

    state: ParallelState
    rc: ResolvedCheckpoint  # as the run reads it: through every view
    recipe: Recipe
    targets: list[str]
    modules: Mapping[str, str]  # the modules the algorithm runs on, each with its format
    cal: Calibrator
    tokens: int  # the calibration tokens of the whole run
    options: object | None  # its options for the whole run (eprt.quant.algorithms.registry.Entry.options)
    expert_stack: int  # routed experts solved at once (the memory plan's)


class Algorithm:
    """A registered algorithm: every method's default is that it adds nothing."""

    name = ""
    measures_again = False  # its pass measures a layer's statistics again after changing it (a balance)

    def memory(
        self,
        rc: ResolvedCheckpoint,
        model: nn.Module,
        targets: list[str],
        modules: Mapping[str, str],
        device,
        params: Mapping[str, object],
    ) -> AlgorithmMemory | None:
        """What it holds of its own in a run over `rc` (every expert; `model`: its meta model) on
        `device`, running on `modules` of the quantized `targets`, each with its typed parameters
        `params` (the registry's; None where it has none); None: nothing."""
        return None

    def view(self, rc: ResolvedCheckpoint, first_expert: int) -> tuple[ResolvedCheckpoint, object | None]:
        return rc, None

    def start(self, ctx: RunContext, viewed: object | None) -> object | None:
        """Its state in the run: by default what its view reads through."""
        return viewed

    def passes(self, ctx: RunContext, state: object | None, rounds_after: bool) -> list[Pass]:
        """`rounds_after`: a rounding with passes of its own runs after this one."""
        return []

    def saved(self, state) -> dict[str, torch.Tensor]:
        """Everything it decided so far, each by a name that stays."""
        return {}

    def restore(self, state, tensors: dict[str, torch.Tensor]) -> None:
        pass

    def record(self, state) -> RecordPart | None:
        """Its part of the calibration record (its tensors, by names its module gives them); None: none."""
        return None

    def apply(
        self, state, model: nn.Module, rc: ResolvedCheckpoint, experts: tuple[int, int] | None, device
    ) -> set[str]:
        """Set what it decided into `model`, loaded from `rc` before it ran (holding routed experts
        `experts`, on `device`); returns the modules whose weights are now as the export writes them."""
        return set()

    def summary(self, state: object | None, ctx: RunContext) -> dict:
        return {}
