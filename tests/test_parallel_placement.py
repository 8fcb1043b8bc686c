"""ExpertPlacement: every rank of every layout agrees on who holds and who computes each expert."""

import pytest
import torch

from eprt.errors import ConfigError
from eprt.parallel.placement import ExpertPlacement
from eprt.parallel.state import expert_groups, rank_coords

LAYOUTS = [(8, 1, 1), (8, 2, 1), (8, 4, 2), (6, 3, 2), (4, 4, 1), (16, 2, 4)]  # (experts, ep, edp)


def layout(E: int, ep: int, edp: int) -> list[ExpertPlacement]:
    """The placement of every global rank, built from the rank's coordinates as ParallelState does."""
    world = ep * edp
    return [
        ExpertPlacement(E, ep, ep_rank, edp, edp_rank)
        for edp_rank, ep_rank in (rank_coords(r, world, ep) for r in range(world))
    ]


@pytest.mark.parametrize("E,ep,edp", LAYOUTS)
def test_every_expert_held_once_per_replica(E, ep, edp):
    places = layout(E, ep, edp)
    _, edp_groups = expert_groups(ep * edp, ep)
    for replica in range(edp):
        held = [e for p in places if p.edp_rank == replica for e in range(p.first, p.first + p.count)]
        assert held == list(range(E))
    for group in edp_groups:  # the ranks of an edp group hold the same experts
        assert len({places[r].range for r in group}) == 1
    assert places[0].ranges() == [p.range for p in places[:ep]]


@pytest.mark.parametrize("E,ep,edp", LAYOUTS)
def test_owner_holds_the_expert_in_the_groups_replica(E, ep, edp):
    places = layout(E, ep, edp)
    for p in places:  # every rank names the same owner
        for e in range(E):
            for g in range(2 * edp + 1):
                owner = places[p.owner_of(e, g)]
                assert owner.first <= e < owner.first + owner.count
                assert owner.edp_rank == g % edp
                assert owner.first + p.local_of(e) == e and p.ep_rank_of(e) == owner.ep_rank
    ids = torch.arange(E).repeat(3)
    groups = torch.arange(3 * E) % 5
    p = places[-1]
    assert p.owner_of(ids, groups).tolist() == [p.owner_of(e, g) for e, g in zip(ids.tolist(), groups.tolist())]


def test_worked_example():
    p = ExpertPlacement(8, ep_size=2, ep_rank=1, edp_size=2, edp_rank=0)
    assert (p.first, p.count, p.ep_rank_of(5), p.local_of(5), p.owner_of(5, 3)) == (4, 4, 1, 1, 3)


def test_refuses_a_split_that_does_not_divide():
    with pytest.raises(ConfigError, match="ep=4 does not divide the 6 routed experts"):
        ExpertPlacement(6, ep_size=4)
    with pytest.raises(ConfigError, match="outside the layout"):
        ExpertPlacement(8, ep_size=2, ep_rank=2)
