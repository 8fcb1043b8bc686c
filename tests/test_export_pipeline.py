"""The export's writer gets each tensor from a second thread that produces ahead of it, and writes small
ones together."""

import struct
import threading

import pytest
import torch
from safetensors.torch import load_file, save_file

from eprt.hf.export import produced_ahead
from eprt.hf.tensors import OutTensor
from eprt.storage import safetensors_io
from eprt.storage.safetensors_io import SafetensorsFile, SafetensorsWriter


def _tensors(n, calls, fail_at=None):
    def produce(i):
        calls.append((i, threading.current_thread().name))
        if i == fail_at:
            raise ValueError(f"tensor {i} is broken")
        return torch.full((4,), i, dtype=torch.int32)

    return [OutTensor(f"t{i}", torch.int32, (4,), lambda i=i: produce(i)) for i in range(n)]


@pytest.mark.parametrize("batch", [1, 2])
def test_in_order_once_each_on_one_thread_and_bounded_ahead(batch):
    calls = []
    tensors = _tensors(10, calls)
    seen = []
    for t, got in produced_ahead(tensors, ahead_bytes=3 * 16, batch_bytes=batch * 16):
        # produced so far: this one and at most the 3 after it (4 x 16 bytes pass the bound of 3 x 16),
        # and the rest of the last batch asked for
        assert len(calls) <= len(seen) + 3 + batch
        seen.append((t.name, got.tolist()))
    assert seen == [(f"t{i}", [i] * 4) for i in range(10)]
    assert [i for i, _ in calls] == list(range(10))
    threads = {name for _, name in calls}
    assert len(threads) == 1 and threading.current_thread().name not in threads


def test_a_producer_error_reaches_the_writer_at_its_tensor():
    calls = []
    got = []
    with pytest.raises(ValueError, match="tensor 5 is broken"):
        for t, _ in produced_ahead(_tensors(40, calls, fail_at=5), ahead_bytes=2 * 16, batch_bytes=16):
            got.append(t.name)
    assert got == [f"t{i}" for i in range(5)]
    assert max(i for i, _ in calls) <= 7  # nothing past the bound ahead of tensor 5 was asked for


def test_small_writes_gathered_between_copies_keep_every_byte_in_place(tmp_path, monkeypatch):
    """The writer gathers small tensors into one write (safetensors_io.WRITE_BUFFER_BYTES); tensors copied
    from a source file between them still land in order: the file reads back, by the safetensors library,
    as what was written, its data section byte for byte the library's own."""
    monkeypatch.setattr(safetensors_io, "WRITE_BUFFER_BYTES", 64)
    tensors = {f"t{i}": torch.arange(n, dtype=torch.int32) + i for i, n in enumerate([3, 40, 5, 2, 7, 30, 1])}
    src, out = str(tmp_path / "src.safetensors"), str(tmp_path / "out.safetensors")
    save_file(tensors, src)
    with SafetensorsFile(src) as f:
        w = SafetensorsWriter(out, [(k, v.dtype, tuple(v.shape)) for k, v in tensors.items()])
        for k, v in tensors.items():
            if k in ("t1", "t3", "t4"):  # t3 and t4 lie side by side: one copy
                w.copy_range(k, f, *f.byte_range(k))
            else:
                w.write(k, v)
        w.close()
    back = load_file(out)
    assert list(back) == list(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())

    def data(path):
        with open(path, "rb") as g:
            raw = g.read()
        return raw[8 + struct.unpack("<Q", raw[:8])[0] :]

    assert data(out) == data(src)
