"""One rank's share of a calibration, as the time probe runs it in a process of its own.

A rank of a run of `world` ranks at ep `ep` holds E/ep routed experts of each MoE layer and runs, at each
step, its own sequences of the step (1/world of them, rounded up); on average it computes as many routed
copies as its tokens make. The probe holds exactly that, in a world of one: the first E/ep experts of a
layer, and `steps` steps of the rank's sequences, with each routed copy sent to the held expert its id
gives modulo E/ep (`ShareDispatcher`). So the probe's memory is one rank's, and its matmuls take a
rank's rows; they come in ep times fewer work units of ep times the rows (an expert's units of a step
merged), which a GPU computes no slower.

What the probe holds is the run's plan (eprt.quant.run.planner) at `RankShare.plan_shape`: the rank's weights
of a layer, its step buffers, and the hidden states of the probe's sequences rather than the whole
calibration's. `plan_probe` prices it and refuses it over the device's limit before the probe starts,
as the run's own plan is refused.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from eprt.errors import ConfigError
from eprt.parallel import ParallelState
from eprt.parallel.dispatch import UnitDispatcher
from eprt.quant.loop.sequences import Schedule, Sequences, own_sequences
from eprt.quant.run.memory_plan import MemoryPlan, RunShape
from eprt.quant.run.planner import Planner
from eprt.units import format_bytes


@dataclass(frozen=True)
class RankShare:
    """Rank `shape.rank`'s share of a run of `shape`, over `steps` steps of the calibration."""

    shape: RunShape
    steps: int

    @property
    def step_sequences(self) -> int:
        """The sequences of one step this rank runs (of the run's largest step)."""
        schedule = self.shape.schedule
        step = min(schedule.groups_per_step * schedule.group_size, self.shape.num_sequences)
        return math.ceil(step / self.shape.world)

    @property
    def num_sequences(self) -> int:
        """The probe's calibration sequences: `steps` steps of this rank's share, no more than the rank
        runs (a run of fewer steps is probed whole: what a layer does once over every sequence, AWQ's
        search, is then timed over as many as the run's)."""
        return min(self.steps * self.step_sequences, math.ceil(self.shape.num_sequences / self.shape.world))

    @property
    def schedule(self) -> Schedule:
        """The probe's calibration sequences in steps of this rank's share, in the run's groups."""
        return Schedule.of(self.num_sequences, self.shape.seq_len, self.step_sequences, self.shape.group_tokens)

    @property
    def eval_sequences(self) -> int:
        """The quality report's held-out sequences this rank runs, all of them."""
        return len(own_sequences(self.shape.eval_sequences, self.shape.rank, self.shape.world))

    @property
    def eval_schedule(self) -> Schedule | None:
        if not self.eval_sequences:
            return None
        held_out = self.shape.eval_schedule
        step = math.ceil(held_out.groups_per_step * held_out.group_size / self.shape.world)
        return Schedule.of(self.eval_sequences, self.shape.seq_len, step, self.shape.group_tokens)

    def held(self, num_experts: int) -> tuple[int, int]:
        """(first, count) of the routed experts the probe holds: one ep rank's count."""
        return 0, num_experts // self.shape.ep

    @property
    def plan_shape(self) -> RunShape:
        """The run's shape whose plan for this rank is what the probe holds: as many calibration
        sequences as give this rank the probe's, in steps of the run's size."""
        return replace(self.shape, num_sequences=self.num_sequences * self.shape.world)

    def sequences(self, state: ParallelState, schedule: Schedule, top_k: int) -> Sequences:
        """`schedule`'s sequences in the probe's world of one, their copies sent to the held experts."""
        sequences = Sequences(state, schedule, top_k)
        sequences.dispatcher = ShareDispatcher(state, sequences.dispatcher.keyspace)
        return sequences


class HeldExperts:
    """A layer's held routed experts, seen as the whole set: the probe's copies go to them alone."""

    def __init__(self, experts):
        self.experts = experts
        self.num_experts = self.count = experts.count
        self.first = 0

    def forward_units(self, x, rows_per_unit_LU):
        return self.experts.forward_units(x, rows_per_unit_LU)


class ShareDispatcher(UnitDispatcher):
    """A world of one holding some of a layer's routed experts: each copy goes to the held expert
    its id gives modulo their count."""

    def __call__(self, x_TD, topk_ids_TK, topk_weights_TK, key_TK, unit_T, units, experts):
        held = HeldExperts(experts)
        return super().__call__(x_TD, topk_ids_TK % held.count, topk_weights_TK, key_TK, unit_T, units, held)


def plan_probe(planner: Planner, share: RankShare, baseline: int, host_baseline: int, limit: int | None) -> MemoryPlan:
    """What the probe holds on its device, refused, naming the way out, where it exceeds `limit`. (The
    plan sizes GPTQ's expert stack to what fits beside the probe's sequences; the probe solves with the
    run's, which fits beside more, so it holds no more than this.)"""
    plan = planner.plan(share.plan_shape, baseline, host_baseline, limit=limit)
    if limit is not None and plan.peak > limit:
        raise ConfigError(
            f"the time probe of rank {share.shape.rank} would peak at {format_bytes(plan.peak)} ({plan.terms()}), "
            f"over {format_bytes(limit)}: it runs {share.steps} steps of {share.step_sequences} sequences of this "
            "rank's; give a smaller --chunk-size (sequences per step), or a larger --ep"
        )
    return plan
