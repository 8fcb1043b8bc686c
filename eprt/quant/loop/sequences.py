"""Which sequences a layer runs, where and when: the schedule of steps and work-unit groups (the
same on every rank), a rank's share of the sequences, and what they carry from layer to layer.

The engine (eprt.quant.loop.engine) runs them; the passes and the memory plan read them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from eprt.models.moe import MoE
from eprt.parallel import ParallelState
from eprt.parallel.dispatch import UnitDispatcher

# Rows an expert's work unit holds on average: enough for a matmul worth a call, few enough
# that a step's exchange buffers stay a sliver of a layer. On a CPU with bf16 arithmetic (AMX)
# a 256-row expert matmul runs at 1.3x the rate of a 128-row one, 512 rows at 1.6x; with 256
# rows bench/modelopt_baseline.py's model calibrates in 15.0 s against 17.4 s with 128, its peak RSS
# 0.81-0.84 GB against 0.72-0.82 GB (2 runs each; 512 rows peak at 0.98 GB).
UNIT_ROWS = 256


def group_tokens(num_experts: int, top_k: int) -> int:
    """Tokens per group of sequences, so that each expert's unit holds UNIT_ROWS rows on average."""
    return UNIT_ROWS * max(num_experts, 1) // max(top_k, 1)


@dataclass(frozen=True)
class Schedule:
    """Which sequences each step of every layer runs: the same on every rank."""

    num_sequences: int
    seq_len: int
    group_size: int  # sequences per expert work unit's group
    groups_per_step: int

    @classmethod
    def of(cls, num_sequences: int, seq_len: int, step_sequences: int, group_tokens: int) -> Schedule:
        group_size = max(1, group_tokens // seq_len)
        return cls(num_sequences, seq_len, group_size, max(1, math.ceil(step_sequences / group_size)))

    @property
    def num_groups(self) -> int:
        return math.ceil(self.num_sequences / self.group_size)

    @property
    def num_steps(self) -> int:
        return math.ceil(self.num_groups / self.groups_per_step)

    def step_groups(self, step: int) -> tuple[int, int]:
        """(first group, count) of `step`."""
        first = step * self.groups_per_step
        return first, min(self.groups_per_step, self.num_groups - first)

    def step_sequences(self, step: int) -> range:
        first, count = self.step_groups(step)
        return range(first * self.group_size, min(self.num_sequences, (first + count) * self.group_size))


class LayerState:
    """One rank's sequences as they stand at a layer boundary: the hidden states [n, T, D] ([n, T,
    streams, D] under a residual rule of several streams); with attention residuals, the
    snapshots the layers so far filed (`DecoderLayer.snapshots`, each as the hidden states); and
    what the layers so far left for the layers after them (`carried`, by name, each [n, ...]:
    eprt.models.decoder.LayerContext.carried; with index sharing the keys the last full indexer
    layer picked, [n, T, T] bool)."""

    def __init__(
        self, hidden: torch.Tensor, blocks: list[torch.Tensor], carried: dict[str, torch.Tensor] | None = None
    ):
        self.hidden, self.blocks = hidden, blocks
        self.carried = {} if carried is None else carried

    def copy(self) -> LayerState:
        """A copy whose hidden states change apart from these (what is filed or carried is replaced
        whole, never changed in place: it is shared)."""
        return LayerState(self.hidden.clone(), list(self.blocks), dict(self.carried))

    def of_sequence(self, li: int) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
        """The snapshots and the carried entries of the sequence at local row `li`, each [1, ...]."""
        return [b[li : li + 1] for b in self.blocks], {k: v[li : li + 1] for k, v in self.carried.items()}


def own_sequences(num_sequences: int, rank: int, world: int) -> list[int]:
    """The global indices of this rank's sequences."""
    return list(range(rank, num_sequences, world))


class Sequences:
    """Sequences that go through the layers together (the calibration ones, the quality report's
    held-out ones): their schedule, the same on every rank; this rank's share, `local` giving each
    global index its row in the hidden states; and the dispatcher of their own work units."""

    def __init__(self, state: ParallelState, schedule: Schedule, top_k: int):
        self.schedule = schedule
        self.mine = own_sequences(schedule.num_sequences, state.rank, state.world)
        self.local = {s: i for i, s in enumerate(self.mine)}
        self.dispatcher = UnitDispatcher(state, schedule.num_sequences * schedule.seq_len * max(top_k, 1))

    @property
    def pairs(self) -> list[tuple[int, int]]:
        """This rank's (global, local) sequences."""
        return list(self.local.items())


@dataclass
class RoutedStep:
    """A step's tokens as the routed experts of `moe` read them: x [T, width] of the step's
    sequences on this rank, each token's global sequence [T] and global key, sequence x seq_len +
    position [T]."""

    moe: MoE
    sequences: Sequences
    step: int
    x_TD: torch.Tensor
    seq_T: torch.Tensor
    key_T: torch.Tensor

    @property
    def unit_T(self) -> torch.Tensor:
        """Each token's global group."""
        return self.seq_T // self.sequences.schedule.group_size

    @property
    def groups(self) -> tuple[int, int]:
        """(first, count) of the step's groups."""
        return self.sequences.schedule.step_groups(self.step)
