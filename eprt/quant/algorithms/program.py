"""A run's program, built from its recipe by one function, `program_of`: the algorithms its rules
run (balances before roundings), each with the modules it runs on. The run, the dry run, the time
estimate's probe and the format search all build theirs here, so what one plans, another runs:
the memory plan takes each algorithm's terms (`Program.planner`), and the layer loop and the probe
take each algorithm's passes (`ProgramRun.passes`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from functools import partial

import torch
from torch import nn

from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.algorithms.base import Algorithm, RunContext
from eprt.quant.algorithms.registry import ALGORITHMS, BALANCE, object_of, params_of
from eprt.quant.algorithms.search.passes import FormatErrors
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import Pass
from eprt.quant.loop.passes import layer_passes
from eprt.quant.loop.passes.quality import QualityStreams
from eprt.quant.recipe import Recipe
from eprt.quant.run.memory_plan import RunShape
from eprt.quant.run.planner import Planner
from eprt.quant.run.workdir import Resumable


@dataclass(frozen=True)
class Step:
    algorithm: Algorithm
    modules: Mapping[str, str]  # the modules it runs on, each with its format
    params: Mapping[str, object]  # each of those modules' typed parameters of it, as its rule sets them

    @property
    def name(self) -> str:
        return self.algorithm.name

    @property
    def balances(self) -> bool:
        return ALGORITHMS[self.name].role == BALANCE


@dataclass(frozen=True)
class Program:
    recipe: Recipe | None
    targets: tuple[str, ...]
    steps: tuple[Step, ...]
    search: bool = False  # the format search's pass runs (its streams are planned)

    def modules(self, name: str) -> Mapping[str, str] | None:
        """The modules algorithm `name` runs on, with their formats; None where it runs on none."""
        return next((s.modules for s in self.steps if s.name == name), None)

    def planner(self, rc: ResolvedCheckpoint, device: torch.device) -> Planner:
        """The memory planner of this program: every algorithm's own terms."""
        targets = list(self.targets)
        memories = [partial(memory_of, s, targets, device) for s in self.steps]
        return Planner.of(rc, device, targets, mtp=bool(self.recipe and self.recipe.mtp), algorithms=memories)

    def shape(self, shape: RunShape) -> RunShape:
        return replace(shape, search=self.search)

    def start(self, rc: ResolvedCheckpoint, first_expert: int) -> ProgramRun:
        """The program in a run over `rc`: each algorithm's view of the checkpoint taken in turn
        (`first_expert`: this rank's first routed expert, where a view holds experts' rows)."""
        viewed = {}
        for s in self.steps:
            rc, viewed[s.name] = s.algorithm.view(rc, first_expert)
        return ProgramRun(self, rc, viewed)


def memory_of(step: Step, targets: list[str], device, rc: ResolvedCheckpoint, model: nn.Module):
    """Step's algorithm's memory, as the planner asks it of its checkpoint and meta model."""
    return step.algorithm.memory(rc, model, targets, step.modules, device, step.params)


def program_of(recipe: Recipe | None, targets: list[str], *, search: bool = False) -> Program:
    """The program of `recipe` over its quantized modules `targets` (None: the layout alone, or the
    format search's first phase, whose recipe is not chosen yet)."""
    if recipe is None:
        return Program(None, tuple(targets), (), search)
    steps = []
    for name, entry in sorted(ALGORITHMS.items(), key=lambda kv: kv[1].role != BALANCE):
        modules = {m: recipe.format_of(m) for m in targets if recipe.runs(m, name)}
        if modules:
            params = {m: params_of(name, recipe.params_of(m)) for m in modules}
            steps.append(Step(object_of(name), modules, params))
    return Program(recipe, tuple(targets), tuple(steps), search)


class ProgramRun:
    """A program in one run: the checkpoint as the run reads it (`rc`, through every algorithm's
    view), then, once the data is read and the memory planned (`begin`), each algorithm's state."""

    def __init__(self, program: Program, rc: ResolvedCheckpoint, viewed: dict[str, object | None]):
        self.program, self.rc, self.viewed = program, rc, viewed
        self.contexts: dict[str, RunContext] = {}
        self.states: dict[str, object | None] = {}

    def begin(
        self,
        state: ParallelState,
        cal: Calibrator,
        *,
        tokens: int,
        options: Mapping[str, object],
        expert_stack: int,
    ) -> ProgramRun:
        """`options`: each algorithm's run options by its name (eprt.quant.algorithms.registry.run_options);
        `expert_stack`: the routed experts an algorithm works on at once (the memory plan's)."""
        p = self.program
        for s in p.steps:
            ctx = RunContext(
                state, self.rc, p.recipe, list(p.targets), s.modules, cal, tokens, options.get(s.name), expert_stack
            )
            self.contexts[s.name] = ctx
            self.states[s.name] = s.algorithm.start(ctx, self.viewed[s.name])
        return self

    def state(self, name: str):
        """Algorithm `name`'s state in the run; None where it does not run or keeps none."""
        return self.states.get(name)

    def resumable(self) -> tuple[Resumable, ...]:
        """What a layer boundary saves of each algorithm that keeps a state (eprt.quant.run.workdir)."""
        return tuple(
            Resumable(s.name, partial(s.algorithm.saved, st), partial(s.algorithm.restore, st))
            for s, st in self._kept()
        )

    def record(self) -> dict:
        """The algorithms' parts of the calibration record, in the registry's order, the order their
        tensors are written (eprt.quant.calibrated.write_calibrated's keywords)."""
        parts = {s.name: s.algorithm.record(st) for s, st in self._kept()}
        return {"parts": {name: parts[name] for name in ALGORITHMS if parts.get(name) is not None}}

    def apply(self, model: nn.Module, rc: ResolvedCheckpoint, experts: tuple[int, int] | None, device) -> set[str]:
        """What every algorithm decided, set into `model` (loaded from `rc` before they ran, holding
        routed experts `experts`); the modules whose weights are now the export's."""
        return {m for s, st in self._kept() for m in s.algorithm.apply(st, model, rc, experts, device)}

    def _kept(self):
        return [(s, self.states[s.name]) for s in self.program.steps if self.states[s.name] is not None]

    def summary(self) -> dict:
        """What the algorithms add to the calibration summary, in their order."""
        return {
            k: v
            for s in self.program.steps
            for k, v in s.algorithm.summary(self.states[s.name], self.contexts[s.name]).items()
        }

    def passes(
        self,
        cal: Calibrator,
        *,
        quality: QualityStreams | None = None,
        format_errors: FormatErrors | None = None,
        statistics: bool = True,
    ) -> list[Pass]:
        """The layer loop's passes: the statistics (not with `statistics` False: the format search's
        are final), the format search's errors, the quality report's streams, every algorithm's."""
        balances, roundings, later = [], [], False
        for s in reversed(self.program.steps):  # a balance asks whether a rounding with passes comes after it
            mine = s.algorithm.passes(self.contexts[s.name], self.states[s.name], later)
            later = later or (bool(mine) and not s.balances)
            (balances if s.balances else roundings)[:0] = mine
        return layer_passes(
            cal,
            self.program.recipe,
            self.rc,
            quality=quality,
            balances=balances,
            roundings=roundings,
            format_errors=format_errors,
            statistics=statistics,
        )
