import os
from datetime import timedelta

import pytest
import torch

from eprt.kernels import combine, grouped_mm, permute
from eprt.parallel import EPDispatcher, ParallelState
from eprt.parallel.dispatch import source_to_expert_order
from tests.multiproc import free_port, run_world

E, K, D = 8, 2, 6
SEED = 1234


class ToyExperts:
    """Experts [first, first + count) of E: y = tanh(a_e * x + b_e), elementwise, so a row's
    result cannot depend on the rows it shares a call with, and dispatch must match bitwise."""

    def __init__(self, first, count):
        g = torch.Generator().manual_seed(SEED)
        a, b = torch.randn(E, D, generator=g), torch.randn(E, D, generator=g)
        self.num_experts, self.first, self.count = E, first, count
        self.a, self.b = a[first : first + count], b[first : first + count]

    def __call__(self, x_sorted, tokens_per_local_expert):
        assert tokens_per_local_expert.shape == (self.count,)
        assert int(tokens_per_local_expert.sum()) == x_sorted.shape[0]
        e = torch.repeat_interleave(torch.arange(self.count), tokens_per_local_expert)
        return torch.tanh(self.a[e] * x_sorted.float() + self.b[e]).to(x_sorted.dtype)


class MatmulExperts(ToyExperts):
    """Experts as one grouped matmul, the way the models run them."""

    def __init__(self, first, count):
        super().__init__(first, count)
        g = torch.Generator().manual_seed(SEED + 1)
        self.w = torch.randn(E, D, D, generator=g)[first : first + count]

    def __call__(self, x_sorted, tokens_per_local_expert):
        return grouped_mm(x_sorted, self.w, torch.cumsum(tokens_per_local_expert, 0).to(torch.int32))


def reference(x, ids, weights, experts_cls):
    """The single-process path with all E experts."""
    x_sorted, counts, order = permute(x, ids, E)
    y = experts_cls(0, E)(x_sorted, counts)
    if x.shape[0] == 0:
        return torch.zeros(0, D)
    return combine(y, order, weights)


def batch(seed, T, allowed, dtype=torch.float32):
    """T tokens, each routed to K distinct experts drawn from `allowed`."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    allowed = torch.tensor(allowed)
    scores = torch.rand(T, len(allowed), generator=g)
    ids = allowed[scores.topk(K, dim=1).indices]
    weights = torch.softmax(torch.randn(T, K, generator=g), dim=1)
    return x, ids, weights


def _cases(rank, world, ep):
    """(name, x, ids, weights, experts class) per rank; every rank runs the same case names."""
    last_block = list(range(E - E // ep, E)) if ep > 1 else [E - 2, E - 1]
    return [
        ("random", *batch(100 + rank, 3 + 2 * rank, range(E)), ToyExperts),
        # Only experts 0 and 1: no token reaches the other experts, nor the other ep ranks;
        # rank 1 brings no tokens at all.
        ("two experts", *batch(200 + rank, 0 if rank == 1 else 5, [0, 1]), ToyExperts),
        # Everything to the last rank's experts; rank 0 brings none.
        ("last rank", *batch(300 + rank, 0 if rank == 0 else 4, last_block), ToyExperts),
        ("no tokens anywhere", *batch(400, 0, range(E)), ToyExperts),
        ("fp8 payload", *batch(500 + rank, 7, range(E), torch.float8_e4m3fn), ToyExperts),
        ("bf16 payload", *batch(600 + rank, 5, range(E), torch.bfloat16), ToyExperts),
        ("grouped matmul", *batch(700 + rank, 9, range(E)), MatmulExperts),
    ]


def _dispatch_layouts(ep_list, ports):
    """For each ep: build the state, dispatch every case, and compare with the reference."""
    out = {}
    for ep, port in zip(ep_list, ports):
        os.environ["MASTER_PORT"] = str(port)
        with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=30)) as state:
            dispatch = EPDispatcher(state)
            first, count = state.placement(E).range
            for name, x, ids, weights, experts_cls in _cases(state.rank, state.world, ep):
                y = dispatch(x, ids, weights, experts_cls(first, count))
                ref = reference(x, ids, weights, experts_cls)
                out[ep, name] = (
                    y.dtype,
                    tuple(y.shape),
                    tuple(ref.shape),
                    torch.equal(y, ref),
                    (y - ref).abs().max().item() if y.numel() else 0.0,
                    torch.allclose(y, ref, rtol=1e-5, atol=1e-6),
                )
    return out


def _check(results, ep_list, world):
    for rank, out in enumerate(results):
        for ep in ep_list:
            for name, x, *_ in _cases(rank, world, ep):
                dtype, shape, ref_shape, bitwise, max_diff, close = out[ep, name]
                where = f"rank {rank}, ep {ep}, {name}"
                assert dtype == torch.float32 and shape == ref_shape == (x.shape[0], D), where
                # grouped_mm is batch invariant (docs/architecture.md, 'Kernels'), so even real matmuls on
                # rows gathered from other ranks give the single-process bits.
                assert bitwise and close, f"{where}: max diff {max_diff}"


@pytest.mark.timeout(120)
def test_dispatch_world2():
    ep_list = [2, 1]
    results = run_world(_dispatch_layouts, 2, ep_list, [free_port(), free_port()], timeout=100)
    _check(results, ep_list, 2)


@pytest.mark.timeout(120)
def test_dispatch_world4():
    ep_list = [4, 2]
    results = run_world(_dispatch_layouts, 4, ep_list, [free_port(), free_port()], timeout=100)
    _check(results, ep_list, 4)


def test_dispatch_single_process():
    dispatch = EPDispatcher(ParallelState.single("cpu"))
    for name, x, ids, weights, experts_cls in _cases(0, 1, 1):
        y = dispatch(x, ids, weights, experts_cls(0, E))
        assert torch.equal(y, reference(x, ids, weights, experts_cls)), name


def test_dispatch_refuses_wrong_expert_range():
    x, ids, weights = batch(0, 3, range(E))
    with pytest.raises(ValueError, match=r"must hold experts \[0, 8\) of 8, but holds \[0, 4\)"):
        EPDispatcher(ParallelState.single("cpu"))(x, ids, weights, ToyExperts(0, 4))


def test_source_to_expert_order():
    # Rank 0 sent 2 rows for local expert 0 and 1 for expert 2; rank 1 sent 1 for expert 0
    # and 3 for expert 1.
    counts_PL = torch.tensor([[2, 0, 1], [1, 3, 0]])
    assert source_to_expert_order(counts_PL).tolist() == [0, 1, 3, 4, 5, 6, 2]
    assert source_to_expert_order(torch.zeros(2, 2, dtype=torch.int64)).tolist() == []
