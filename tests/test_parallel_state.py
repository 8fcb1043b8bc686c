import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from eprt.errors import ConfigError
from eprt.parallel import ParallelState, check_devices, check_ep, expert_groups, rank_coords, valid_ep
from tests.multiproc import free_port, run_world

LAYOUTS = [(1, 1), (2, 2), (2, 1), (4, 4), (4, 2), (8, 4), (8, 2)]


@pytest.mark.parametrize("world,ep", LAYOUTS)
def test_group_arithmetic(world, ep):
    ep_groups, edp_groups = expert_groups(world, ep)
    # ep innermost: an ep group is a block of ep consecutive ranks; an edp group takes the
    # same place in every block.
    assert ep_groups == [[b * ep + i for i in range(ep)] for b in range(world // ep)]
    assert edp_groups == [[b * ep + i for b in range(world // ep)] for i in range(ep)]
    for rank in range(world):
        edp_rank, ep_rank = rank_coords(rank, world, ep)
        assert ep_groups[edp_rank][ep_rank] == rank
        assert edp_groups[ep_rank][edp_rank] == rank
    for groups in (ep_groups, edp_groups):
        assert sorted(r for g in groups for r in g) == list(range(world))


def test_group_arithmetic_megatron_example():
    assert expert_groups(8, 4) == ([[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 4], [1, 5], [2, 6], [3, 7]])


def test_refusals_name_valid_choices():
    with pytest.raises(ConfigError, match=r"ep=3 does not divide the world size 4; valid ep for world 4: 1, 2, 4"):
        check_ep(4, 3)
    with pytest.raises(
        ConfigError,
        match=r"ep=4 does not divide the 6 routed experts; "
        r"valid ep for world 8 and 6 experts: 1, 2",
    ):
        check_ep(8, 4, 6)
    with pytest.raises(ConfigError, match="valid ep"):
        check_ep(4, 0)
    assert valid_ep(8) == [1, 2, 4, 8] and valid_ep(8, 12) == [1, 2, 4]


def test_device_refusals():
    check_devices([(0, 2, "a"), (0, 2, "a")])  # all CPU
    check_devices([(2, 2, "a"), (2, 2, "a"), (1, 1, "b")])  # one GPU per rank on each node
    with pytest.raises(ConfigError, match="ranks 1, 2 see no CUDA device while the others do"):
        check_devices([(1, 1, "a"), (0, 2, "b"), (0, 2, "b")])
    with pytest.raises(
        ConfigError,
        match=r"4 ranks run on host b, which has 2 visible GPUs.*"
        r"run at most 2 processes per node",
    ):
        check_devices([(8, 8, "a"), (2, 4, "b")])


def test_single_process_state():
    state = ParallelState.single("cpu")
    assert (state.rank, state.world, state.ep_rank, state.ep_size, state.edp_rank, state.edp_size) == (0, 1, 0, 1, 0, 1)
    assert state.placement(6).range == (0, 6)
    t = torch.tensor([3.0])
    assert state.all_reduce(t, "edp") is t and t.item() == 3.0
    state.close()
    env = {k: os.environ.pop(k) for k in ("WORLD_SIZE", "RANK") if k in os.environ}
    try:
        assert ParallelState.from_env(num_experts=6).world == 1
        with pytest.raises(ConfigError, match="valid ep for world 1: 1"):
            ParallelState.from_env(ep=2)
    finally:
        os.environ.update(env)


def _build_world(second_port):
    """Refusals, then two layouts built for real, in one world of 4."""
    out = {}
    for kwargs in ({"ep": 3}, {"ep": 4, "num_experts": 6}):
        try:
            ParallelState.from_env(timeout=timedelta(seconds=20), **kwargs)
        except ConfigError as e:
            out[str(kwargs)] = str(e)
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=20)) as state:
        out["ep2"] = _describe(state)
        try:
            state.check_experts(5)
        except ConfigError as e:
            out["experts5"] = str(e)
    os.environ["MASTER_PORT"] = str(second_port)
    with ParallelState.from_env(num_experts=8, timeout=timedelta(seconds=20)) as state:
        out["ep4"] = _describe(state)
    return out


def _describe(state):
    ranks = {name: dist.get_process_group_ranks(getattr(state, name)) for name in ("ep_group", "edp_group", "dp_group")}
    coords = (state.rank, state.ep_rank, state.ep_size, state.edp_rank, state.edp_size)
    # The groups carry traffic: the ep group's max rank, and the edp group's sum of ranks.
    mx = state.all_reduce(torch.tensor([float(state.rank)]), "ep")
    sm = state.all_reduce(torch.tensor([float(state.rank)]), "edp", dist.ReduceOp.SUM)
    return (
        ranks,
        coords,
        list(state.ep_ranks),
        list(state.edp_ranks),
        state.placement(8).range,
        state.backend,
        str(state.device),
        mx.item(),
        sm.item(),
    )


@pytest.mark.timeout(120)
def test_groups_built_in_processes():
    results = run_world(_build_world, 4, free_port(), timeout=100)
    for rank, out in enumerate(results):
        assert out["{'ep': 3}"] == "ep=3 does not divide the world size 4; valid ep for world 4: 1, 2, 4"
        assert out["{'ep': 4, 'num_experts': 6}"] == (
            "ep=4 does not divide the 6 routed experts; valid ep for world 4 and 6 experts: 1, 2"
        )
        assert "ep=2 does not divide the 5 routed experts" in out["experts5"]

        ranks, coords, ep_ranks, edp_ranks, erange, backend, device, mx, sm = out["ep2"]
        ep_group = [0, 1] if rank < 2 else [2, 3]
        edp_group = [rank % 2, rank % 2 + 2]
        assert ranks == {"ep_group": ep_group, "edp_group": edp_group, "dp_group": [0, 1, 2, 3]}
        assert ep_ranks == ep_group and edp_ranks == edp_group
        assert coords == (rank, rank % 2, 2, rank // 2, 2)
        assert erange == (4 * (rank % 2), 4)
        assert (backend, device) == ("gloo", "cpu")
        assert mx == max(ep_group) and sm == sum(edp_group)

        ranks, coords, ep_ranks, edp_ranks, erange, *_ = out["ep4"]
        assert ranks == {"ep_group": [0, 1, 2, 3], "edp_group": [rank], "dp_group": [0, 1, 2, 3]}
        assert coords == (rank, rank, 4, 0, 1)
        assert erange == (2 * rank, 2)
