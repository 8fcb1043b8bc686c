"""The export's writer gets each tensor from a second thread that produces ahead of it."""

import threading

import pytest
import torch

from eprt.hf.export import produced_ahead
from eprt.hf.tensors import OutTensor


def _tensors(n, calls, fail_at=None):
    def produce(i):
        calls.append((i, threading.current_thread().name))
        if i == fail_at:
            raise ValueError(f"tensor {i} is broken")
        return torch.full((4,), i, dtype=torch.int32)

    return [OutTensor(f"t{i}", torch.int32, (4,), lambda i=i: produce(i)) for i in range(n)]


def test_in_order_once_each_on_one_thread_and_bounded_ahead():
    calls = []
    tensors = _tensors(10, calls)
    seen = []
    for t, got in produced_ahead(tensors, ahead_bytes=3 * 16):
        # produced so far: this one and at most the 3 after it (4 x 16 bytes pass the bound of 3 x 16)
        assert len(calls) <= len(seen) + 4
        seen.append((t.name, got.tolist()))
    assert seen == [(f"t{i}", [i] * 4) for i in range(10)]
    assert [i for i, _ in calls] == list(range(10))
    threads = {name for _, name in calls}
    assert len(threads) == 1 and threading.current_thread().name not in threads


def test_a_producer_error_reaches_the_writer_at_its_tensor():
    calls = []
    got = []
    with pytest.raises(ValueError, match="tensor 5 is broken"):
        for t, _ in produced_ahead(_tensors(40, calls, fail_at=5), ahead_bytes=2 * 16):
            got.append(t.name)
    assert got == [f"t{i}" for i in range(5)]
    assert max(i for i, _ in calls) <= 7  # nothing past the bound ahead of tensor 5 was asked for
