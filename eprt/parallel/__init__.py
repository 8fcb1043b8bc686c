"""Process groups, fail-together guards and token dispatch for expert-parallel runs."""

from eprt.parallel.dispatch import EPDispatcher
from eprt.parallel.guard import RankFailure, fail_together
from eprt.parallel.output import write_together
from eprt.parallel.placement import ExpertPlacement
from eprt.parallel.state import ParallelState, check_devices, check_ep, expert_groups, rank_coords, valid_ep

__all__ = [
    "ParallelState",
    "fail_together",
    "RankFailure",
    "EPDispatcher",
    "ExpertPlacement",
    "check_devices",
    "check_ep",
    "expert_groups",
    "rank_coords",
    "valid_ep",
    "write_together",
]
