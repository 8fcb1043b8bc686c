"""Kernels: Triton (under TRITON_INTERPRET=1 without a GPU) and torch fallbacks against plain
loops, and bitwise batch invariance of the grouped GEMM (docs/architecture.md, 'Layout-invariant calibration')."""

import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.nn.functional as F

from eprt.kernels import combine, grouped_mm, permute, unit_mlp
from eprt.kernels.backend import matmul_dtype, triton_available, use_triton
from eprt.kernels.cpu_workers import cpu_workers, for_each
from eprt.kernels.grouped_gemm import grouped_mm_loop, grouped_mm_torch
from eprt.kernels.permute import combine_torch, permute_torch
from eprt.models.layers import linear, silu_mul
from eprt.quant.numerics import chunk_buffer


@pytest.fixture
def triton():
    """The Triton kernels' tests skip, as every test of an optional package does, where it is not installed."""
    return pytest.importorskip("triton")


# The Triton tests run the real kernels where there is a GPU and the interpreter elsewhere.
TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

DTYPES = [torch.float32, torch.bfloat16]
# Both sides accumulate in fp32 in different orders; bf16 outputs may then round one ulp apart.
TOL = {
    torch.float32: dict(rtol=1e-5, atol=1e-4),
    torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
    torch.float16: dict(rtol=2e-3, atol=2e-3),
}

# name: (rows per expert, N, K). Default Triton blocks are 64 x 128 x (64 | 32), CPU tiles 64 rows.
GMM_CASES = {
    "empty_experts": ([0, 5, 0, 3, 0], 24, 40),
    "one_row": ([1], 8, 16),
    "uneven_ragged_k_n": ([17, 3, 70], 40, 72),
    "no_rows": ([0, 0], 8, 8),
    "several_m_and_n_tiles": ([130, 0, 65], 136, 100),
}


def _offsets(counts, device="cpu"):
    return torch.tensor(counts, dtype=torch.int64).cumsum(0).to(torch.int32).to(device)


def _problem(counts, N, K, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(sum(counts), K, generator=g).to(dtype)
    w = torch.randn(len(counts), N, K, generator=g).to(dtype)
    return x.to(device), w.to(device), _offsets(counts, device)


def _grouped_mm_triton(*args, **kwargs):
    from eprt.kernels.grouped_gemm_triton import grouped_mm_triton

    return grouped_mm_triton(*args, **kwargs)


# ---------------------------------------------------------------- grouped GEMM: values


@pytest.mark.parametrize("dtype", DTYPES + [torch.float16], ids=str)
@pytest.mark.parametrize("case", GMM_CASES)
def test_fallback_matches_loop(case, dtype):
    x, w, offsets = _problem(*GMM_CASES[case], dtype)
    y = grouped_mm_torch(x, w, offsets)
    assert y.dtype == dtype and y.shape == (x.shape[0], w.shape[1])
    torch.testing.assert_close(y.float(), grouped_mm_loop(x, w, offsets).float(), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", GMM_CASES)
def test_triton_matches_fallback_and_loop(triton, case, dtype):
    x, w, offsets = _problem(*GMM_CASES[case], dtype, device=TRITON_DEVICE)
    y = _grouped_mm_triton(x, w, offsets)
    assert y.dtype == dtype and y.shape == (x.shape[0], w.shape[1])
    torch.testing.assert_close(y.float(), grouped_mm_loop(x, w, offsets).float(), **TOL[dtype])
    on_cpu = grouped_mm_torch(x.cpu(), w.cpu(), offsets.cpu())
    torch.testing.assert_close(y.cpu().float(), on_cpu.float(), **TOL[dtype])


def test_triton_small_blocks_match_loop(triton):
    """Many tiles per expert and many K steps, with every edge ragged."""
    x, w, offsets = _problem([37, 0, 1, 50], 45, 83, torch.float32, device=TRITON_DEVICE)
    y = _grouped_mm_triton(x, w, offsets, block_m=16, block_n=16, block_k=16)
    torch.testing.assert_close(y, grouped_mm_loop(x, w, offsets), **TOL[torch.float32])


# ---------------------------------------------------------------- grouped GEMM: batch invariance


def _assert_batch_invariant(fn, N, K, dtype, device="cpu", weight_views=None, seed=0, integers=False):
    """Every row's output equals, bit for bit, the same row computed alone.

    Rows are drawn with repeats from a pool and placed at varied positions in two experts
    whose counts straddle tile edges, so a row is seen at many tile positions and batch sizes.
    `integers`: small integer values, whose products and sums are exact in any order, so that
    only the kernel's indexing and masking can make a row differ.
    """
    g = torch.Generator().manual_seed(seed)
    draw = (
        (lambda *shape: torch.randint(-4, 5, shape, generator=g).float())
        if integers
        else (lambda *shape: torch.randn(*shape, generator=g))
    )
    pool = draw(48, K).to(dtype).to(device)
    w = draw(2, N, K).to(dtype).to(device)
    alone = [
        torch.cat([fn(pool[i : i + 1], w, _offsets([1, 0] if e == 0 else [0, 1], device)) for i in range(len(pool))])
        for e in (0, 1)
    ]
    layouts = [(1, 0), (0, 2), (5, 63), (64, 1), (65, 130), (3, 200)]
    for w_view in [w] + [view(w) for view in (weight_views or [])]:
        for c0, c1 in layouts:
            idx = torch.randint(0, len(pool), (c0 + c1,), generator=g).to(device)
            y = fn(pool[idx], w_view, _offsets([c0, c1], device))
            assert torch.equal(y[:c0], alone[0][idx[:c0]]), (N, K, dtype, c0, c1)
            assert torch.equal(y[c0:], alone[1][idx[c0:]]), (N, K, dtype, c0, c1)


def _misaligned(w):
    """The same weights starting one element past a 64-byte boundary, as an expert slice may."""
    storage = torch.empty(w.numel() + 1, dtype=w.dtype, device=w.device)
    out = storage[1:].view(w.shape)
    out.copy_(w)
    return out


def _column_major(w):
    return w.transpose(1, 2).contiguous().transpose(1, 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("N,K", [(7, 5), (96, 200), (512, 256), (64, 2048)])
def test_fallback_batch_invariant(N, K, dtype):
    _assert_batch_invariant(grouped_mm_torch, N, K, dtype, weight_views=[_misaligned, _column_major])


def test_grouped_mm_dispatches_cpu_to_the_invariant_fallback():
    x, w, offsets = _problem([3, 70], 24, 40, torch.float32)
    assert not use_triton(x)
    assert torch.equal(grouped_mm(x, w, offsets), grouped_mm_torch(x, w, offsets))
    _assert_batch_invariant(grouped_mm, 24, 40, torch.float32)


# Under the interpreter a tile's dot is numpy's matmul, whose sums on some CPUs follow a row's
# place in the tile: there the kernel's own part, which rows and columns each tile reads and
# writes, is checked with values every summation order adds exactly.
INTERPRETED = TRITON_DEVICE == "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("N,K", [(40, 72), (7, 5)])
def test_triton_batch_invariant(triton, N, K, dtype):
    _assert_batch_invariant(_grouped_mm_triton, N, K, dtype, device=TRITON_DEVICE, integers=INTERPRETED)


def test_triton_batch_invariant_small_blocks(triton):
    def small_blocks(x, w, offsets):
        return _grouped_mm_triton(x, w, offsets, block_m=16, block_n=16, block_k=16)

    _assert_batch_invariant(small_blocks, 20, 100, torch.float32, device=TRITON_DEVICE, integers=INTERPRETED)


# ---------------------------------------------------------------- grouped GEMM: refusals


@pytest.mark.parametrize(
    "offsets, message",
    [
        (torch.tensor([2, 5], dtype=torch.int64), "int32"),
        (torch.tensor([2, 4], dtype=torch.int32), "ending at M=5"),
        (torch.tensor([3, 2, 5], dtype=torch.int32), "int32 \\[E=2\\]"),
        (torch.tensor([6, 5], dtype=torch.int32), "non-decreasing"),
    ],
)
def test_grouped_mm_refuses_bad_offsets(offsets, message):
    x, w, _ = _problem([2, 3], 8, 16, torch.float32)
    with pytest.raises(ValueError, match=message):
        grouped_mm(x, w, offsets)


def test_grouped_mm_refuses_bad_shapes():
    x, w, offsets = _problem([2, 3], 8, 16, torch.float32)
    with pytest.raises(ValueError, match="K=16 but w has K=15"):
        grouped_mm(x, w[:, :, :15], offsets)
    with pytest.raises(ValueError, match="one dtype"):
        grouped_mm(x, w.bfloat16(), offsets)


# ---------------------------------------------------------------- permute / combine


def _permute_loop(x, ids, num_experts):
    T, K = ids.shape
    order = [t * K + k for e in range(num_experts) for t in range(T) for k in range(K) if ids[t, k] == e]
    order = torch.tensor(order, dtype=torch.int64)
    counts = torch.tensor([int((ids == e).sum()) for e in range(num_experts)], dtype=torch.int64)
    return x[order // K], counts, order


def _combine_loop(y_sorted, order, weights):
    T, K = weights.shape
    out = torch.zeros(T, y_sorted.shape[1])
    for t in range(T):
        acc = torch.zeros(y_sorted.shape[1])
        for k in range(K):
            j = int((order == t * K + k).nonzero())
            acc = acc + weights[t, k].float() * y_sorted[j].float()
        out[t] = acc
    return out


# name: (T, K, D, E, experts routed to). "crowded" leaves most experts empty; "top4_wide"
# spans two column blocks of the Triton kernels.
ROUTE_CASES = {
    "top2": (11, 2, 40, 5, 5),
    "top1": (7, 1, 8, 3, 3),
    "top4_wide": (9, 4, 1100, 8, 8),
    "crowded": (10, 3, 16, 6, 3),
    "no_tokens": (0, 2, 8, 4, 4),
}


def _routing(T, K, D, E, used, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, D, generator=g).to(dtype)
    ids = torch.zeros(T, K, dtype=torch.int64)
    for t in range(T):
        ids[t] = torch.randperm(used, generator=g)[:K]
    return x, ids, torch.rand(T, K, generator=g)


def _permute_impls():
    impls = [("torch", permute_torch, combine_torch, "cpu")]
    if triton_available():
        from eprt.kernels.permute_triton import combine_triton, permute_triton

        impls.append(("triton", permute_triton, combine_triton, TRITON_DEVICE))
    return impls


@pytest.mark.parametrize("impl", _permute_impls(), ids=lambda i: i[0])
@pytest.mark.parametrize("case", ROUTE_CASES)
def test_permute_matches_loop(case, impl):
    _, permute_fn, _, device = impl
    T, K, D, E, used = ROUTE_CASES[case]
    x, ids, _ = _routing(T, K, D, E, used)
    got = permute_fn(x.to(device), ids.to(device), E)
    want = _permute_loop(x, ids, E)
    for g, w in zip(got, want):
        assert torch.equal(g.cpu(), w)


@pytest.mark.parametrize("impl", _permute_impls(), ids=lambda i: i[0])
@pytest.mark.parametrize("case", ROUTE_CASES)
def test_combine_matches_loop_bitwise(case, impl):
    """Same fp32 operations (multiply, then add; no FMA) in the same k order: equal bits."""
    _, permute_fn, combine_fn, device = impl
    T, K, D, E, used = ROUTE_CASES[case]
    x, ids, weights = _routing(T, K, D, E, used)
    y_sorted, _, order = permute_torch(x, ids, E)
    y_sorted = y_sorted * 3  # stands in for the experts
    got = combine_fn(y_sorted.to(device), order.to(device), weights.to(device))
    want = _combine_loop(y_sorted, order, weights)
    assert got.dtype == torch.float32
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("workers", [1, 2])
def test_combine_in_pieces_on_workers_matches_loop_bitwise(workers):
    """The CPU combine sums COMBINE_TOKENS tokens a piece, on the workers: a step of many
    tokens, cut in pieces and summed on any thread, gives the bits of the one-pass loop."""
    from eprt.kernels.permute import COMBINE_TOKENS

    T, K, D, E = 2 * COMBINE_TOKENS + 13, 3, 24, 6
    x, ids, weights = _routing(T, K, D, E, E, seed=1)
    y_sorted, _, order = permute_torch(x, ids, E)
    with cpu_workers(workers):
        got = combine_torch(y_sorted * 3, order, weights)
    assert torch.equal(got, _combine_loop(y_sorted * 3, order, weights))


@pytest.mark.parametrize("impl", _permute_impls(), ids=lambda i: i[0])
def test_combine_ignores_where_copies_sit(impl):
    """A token's sum is the same bits whatever rows its copies occupy and whoever else is in the call."""
    _, _, combine_fn, device = impl
    x, ids, weights = _routing(12, 4, 64, 8, 8, dtype=torch.float32, seed=1)
    y_sorted, _, order = permute_torch(x * 1.7, ids, 8)
    full = combine_fn(y_sorted.to(device), order.to(device), weights.to(device))
    shuffle = torch.randperm(len(order), generator=torch.Generator().manual_seed(2))
    shuffled = combine_fn(y_sorted[shuffle].to(device), order[shuffle].to(device), weights.to(device))
    assert torch.equal(full, shuffled)
    # The first 5 tokens alone: their copies re-sorted among fewer rows.
    y5, _, order5 = permute_torch(x[:5] * 1.7, ids[:5], 8)
    assert torch.equal(combine_fn(y5.to(device), order5.to(device), weights[:5].to(device)), full[:5])


def test_permute_combine_round_trip_and_refusals():
    x, ids, weights = _routing(11, 2, 40, 5, 5, dtype=torch.float32)
    x_sorted, counts, order = permute(x, ids, 5)
    assert int(counts.sum()) == 22
    torch.testing.assert_close(combine(x_sorted, order, weights), weights.sum(1, keepdim=True) * x)
    with pytest.raises(ValueError, match="expert ids must lie in \\[0, 4\\)"):
        permute(x, ids, 4)
    with pytest.raises(ValueError, match="do not match"):
        combine(x_sorted, order, weights[:5])


# ---------------------------------------------------------------- optional triton


def test_kernels_import_and_run_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from eprt.kernels import grouped_mm, permute, combine\n"
        "from eprt.kernels.backend import triton_available\n"
        "assert not triton_available()\n"
        "x = torch.randn(5, 16); w = torch.randn(2, 8, 16)\n"
        "y = grouped_mm(x, w, torch.tensor([2, 5], dtype=torch.int32))\n"
        "xs, counts, order = permute(x, torch.tensor([[0], [1], [0], [1], [1]]), 2)\n"
        "combine(xs, order, torch.ones(5, 1))\n"
        "assert 'triton' not in {m.split('.')[0] for m, v in sys.modules.items() if v is not None}\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# ---------------------------------------------------------------- CPU: matmul dtype, worker threads


def test_a_cpu_bf16_matmul_is_its_fp32_product_rounded_once():
    """On a CPU without bf16 arithmetic every bf16 matmul (dense and experts) multiplies in fp32
    and rounds once to bf16; where the CPU has it, the BLAS's own bf16 GEMM runs. Either way the
    result is the exact product to within bf16 rounding."""
    g = torch.Generator().manual_seed(0)
    # wide enough that the BLAS's bf16 GEMM sums some outputs in another order than the fp32 one
    x, w13 = torch.randn(128, 1024, generator=g).bfloat16(), torch.randn(1, 1152, 1024, generator=g).bfloat16()
    w2 = torch.randn(1, 1024, 576, generator=g).bfloat16()
    cpu = torch.device("cpu")
    native = any(
        getattr(torch.cpu, probe, lambda: False)() for probe in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    )
    assert matmul_dtype(torch.bfloat16, cpu) == (torch.bfloat16 if native else torch.float32)
    assert matmul_dtype(torch.float32, cpu) == torch.float32
    y = linear(x, w13[0])
    h, y_units = unit_mlp(x, w13, w2, silu_mul, torch.tensor([[128]]))
    assert y.dtype == h.dtype == y_units.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), x.double() @ w13[0].double().T, rtol=2**-7, atol=0.2)
    if not native:
        assert torch.equal(y, F.linear(x.float(), w13[0].float()).bfloat16())
        assert torch.equal(h, silu_mul(*y.chunk(2, dim=-1)))
        assert torch.equal(y_units, F.linear(h.float(), w2[0].float()).bfloat16())


def test_unit_mlp_gives_the_same_bits_on_any_number_of_workers():
    """Experts of one call run on eprt.kernels.cpu_workers' threads, each whole on one: the bits
    do not depend on how many there are."""
    g = torch.Generator().manual_seed(1)
    E, U, D, I = 6, 3, 64, 48
    counts = torch.randint(0, 40, (E, U), generator=g)
    counts[2] = 0  # an expert no row reaches
    x = torch.randn(int(counts.sum()), D, generator=g).bfloat16()
    w13, w2 = torch.randn(E, 2 * I, D, generator=g).bfloat16(), torch.randn(E, D, I, generator=g).bfloat16()
    alone = unit_mlp(x, w13, w2, silu_mul, counts)
    for workers in (2, 3):
        with cpu_workers(workers):
            assert torch.get_num_threads() == 1
            got = unit_mlp(x, w13, w2, silu_mul, counts)
        assert all(torch.equal(a, b) for a, b in zip(alone, got)), workers


def test_cpu_workers_run_every_piece_once_and_raise_a_pieces_error_after_all_stop():
    cpu, threads = torch.device("cpu"), torch.get_num_threads()
    seen, names = [], set()

    def body(i, bufs):
        bufs.append(i)  # each worker's own buffers
        seen.append(i)
        names.add(threading.current_thread().name)
        time.sleep(0.002)

    with cpu_workers(2):
        for_each(range(40), list, body, cpu)
    assert sorted(seen) == list(range(40)) and len(names) == 2
    assert torch.get_num_threads() == threads

    done = []

    def failing(i, _):
        if i == 1:
            raise ValueError("piece 1 failed")
        time.sleep(0.01)
        done.append(i)

    with cpu_workers(2), pytest.raises(ValueError, match="piece 1 failed"):
        for_each(range(6), lambda: None, failing, cpu)
    assert sorted(done) == [0, 2, 3, 4, 5]  # the other worker went on; nothing ran after the raise


def test_chunk_buffers_are_each_threads_own_and_kept_from_call_to_call():
    """The quantizers' chunk buffers (eprt.quant.numerics.chunk_buffer): a thread gets its own
    memory back on its next call, and no two threads share one."""
    cpu = torch.device("cpu")
    first = chunk_buffer("test.slot", (4, 8), torch.float32, cpu)
    again = chunk_buffer("test.slot", (2, 8), torch.float32, cpu)
    assert again.shape == (2, 8) and again.data_ptr() == first.data_ptr()
    assert chunk_buffer("test.other", (4, 8), torch.float32, cpu).data_ptr() != first.data_ptr()
    assert chunk_buffer("test.slot", (4, 8), torch.int32, cpu).data_ptr() != first.data_ptr()
    elsewhere = []
    t = threading.Thread(target=lambda: elsewhere.append(chunk_buffer("test.slot", (4, 8), torch.float32, cpu)))
    t.start()
    t.join()
    assert elsewhere[0].data_ptr() != first.data_ptr()
    assert chunk_buffer("test.slot", (16, 8), torch.float32, cpu).shape == (16, 8)  # grows when asked for more
    with torch.inference_mode():  # made in inference mode, written out of it (the export after calibration)
        chunk_buffer("test.fresh", (4, 8), torch.float32, cpu).zero_()
    chunk_buffer("test.fresh", (4, 8), torch.float32, cpu).zero_()
