"""Reading one checkpoint from several threads (the export's CPU workers read expert rows side by
side) and writing while the disk catches up (the writer syncs behind)."""

import os
import threading

import pytest
import torch
from safetensors.torch import load_file

from eprt.hf.convert import convert_hf
from eprt.storage import safetensors_io
from eprt.storage.checkpoint import Checkpoint
from eprt.storage.safetensors_io import save_tensors
from eprt.testing.tiny import make_tiny


@pytest.fixture(scope="module")
def ck_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("threads")
    return convert_hf(make_tiny("qwen3_moe", str(d / "hf")), str(d / "ck"), progress=False)


def test_threads_reading_one_checkpoint_get_its_rows_and_count_each_byte_once(ck_dir):
    """Every thread gets the rows one thread alone reads, each file is opened (its header read)
    once, and every byte read is counted."""
    with Checkpoint(ck_dir) as alone:
        stacked = [n for n in alone.names() if n.endswith(".experts.w13")]
        jobs = [(n, e) for n in stacked for e in range(alone.meta(n).shape[0])]
        want = {(n, e): alone.read(n, rows=(e, e + 1)) for n, e in jobs}
        want_bytes = alone.bytes_read
    for attempt in range(5):  # the threads meet in the first reads of each file: give them chances
        got, start = {}, threading.Barrier(8)
        with Checkpoint(ck_dir) as ck:

            def reader(k: int) -> None:
                start.wait()
                for job in jobs[k::8]:
                    got[job] = ck.read(job[0], rows=(job[1], job[1] + 1))

            threads = [threading.Thread(target=reader, args=(k,)) for k in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert len(stacked) > 1 and sorted(got) == sorted(want) and all(torch.equal(got[j], want[j]) for j in jobs)
            assert ck.bytes_read == want_bytes, attempt


def test_the_writer_syncs_behind_and_writes_the_file_safetensors_reads(tmp_path, monkeypatch):
    synced = []
    monkeypatch.setattr(safetensors_io, "SYNC_BEHIND_BYTES", 1 << 16)
    real = os.fdatasync
    monkeypatch.setattr(os, "fdatasync", lambda fd: (synced.append(os.fstat(fd).st_ino), real(fd)))
    tensors = {f"t{i}": torch.randn(128, 256) for i in range(8)}  # 128 KiB each
    path = str(tmp_path / "x.safetensors")
    save_tensors(path, tensors)  # nothing else syncs: the output's own sync comes with its directory
    assert synced and set(synced) == {os.stat(path).st_ino}
    got = load_file(path)
    assert sorted(got) == sorted(tensors) and all(torch.equal(got[k], v) for k, v in tensors.items())
