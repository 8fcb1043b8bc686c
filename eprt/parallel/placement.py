"""Which rank holds, and which rank computes, each routed expert: the one place that says so.

The world factors as edp x ep, ep innermost (see `eprt.parallel.state`). Ep rank r holds the
r-th contiguous block of E/ep experts, and every edp replica holds the same blocks. A work unit
(expert e, calibration group g) is computed by the holder of e in replica g % edp.

Worked example: E = 8 experts, world 4 = edp 2 x ep 2, global rank = edp_rank * ep + ep_rank.

    ep rank 0 holds experts [0, 4), ep rank 1 holds [4, 8): count 4, first 0 or 4
    expert 5: ep rank 5 // 4 = 1, local index 5 % 4 = 1
    unit (expert 5, group 3): replica 3 % 2 = 1, so global rank 1 * 2 + 1 = 3

so `ExpertPlacement(8, ep_size=2, ep_rank=1, edp_size=2, edp_rank=0)` has first 4, count 4,
ep_rank_of(5) 1, local_of(5) 1 and owner_of(5, 3) 3. The per-expert methods take an int or an
integer tensor of expert ids alike.
"""

from __future__ import annotations

from dataclasses import dataclass

from eprt.errors import ConfigError


@dataclass(frozen=True)
class ExpertPlacement:
    """The routed experts of one rank of an (edp, ep) layout; a single process holds them all."""

    num_experts: int
    ep_size: int = 1
    ep_rank: int = 0
    edp_size: int = 1
    edp_rank: int = 0

    def __post_init__(self):
        if self.ep_size < 1 or self.num_experts % self.ep_size:
            raise ConfigError(f"ep={self.ep_size} does not divide the {self.num_experts} routed experts")
        if not (0 <= self.ep_rank < self.ep_size and 0 <= self.edp_rank < self.edp_size):
            raise ConfigError(
                f"rank (edp {self.edp_rank}, ep {self.ep_rank}) is outside the layout "
                f"edp {self.edp_size} x ep {self.ep_size}"
            )

    @property
    def count(self) -> int:
        """Experts each ep rank holds."""
        return self.num_experts // self.ep_size

    @property
    def first(self) -> int:
        """The first expert this rank holds."""
        return self.ep_rank * self.count

    @property
    def range(self) -> tuple[int, int]:
        """(first, count): this rank holds experts [first, first + count)."""
        return self.first, self.count

    def ranges(self) -> list[tuple[int, int]]:
        """(first, count) of every ep rank, in ep-rank order."""
        return [(r * self.count, self.count) for r in range(self.ep_size)]

    def ep_rank_of(self, expert):
        """The ep rank that holds `expert`."""
        return expert // self.count

    def local_of(self, expert):
        """`expert`'s index among the experts of the rank that holds it."""
        return expert % self.count

    def owner_of(self, expert, group):
        """The global rank that computes the work unit (`expert`, calibration `group`)."""
        return (group % self.edp_size) * self.ep_size + self.ep_rank_of(expert)
