"""A rank reading experts [a, b) gets exactly those experts and reads only their bytes from disk."""

import os

import pytest
import torch

from eprt.hf.convert import convert_hf
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.hf_utils import read_hf_tensors


def rchar() -> int:
    """Bytes this process has asked read()/pread() for: the kernel's own count, /proc/self/io."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("sliced")
    src = make_tiny("qwen3_moe", str(d / "hf"), dtype="fp32")
    return src, convert_hf(src, str(d / "ck"), progress=False)


@pytest.mark.parametrize("a,b", [(0, 1), (2, 5), (7, 8), (0, 8), (3, 3)])
def test_rows_are_the_source_experts(tiny, a, b):
    src, ck_dir = tiny
    hf = read_hf_tensors(src)
    ck = Checkpoint(ck_dir)
    w13 = ck.read("model.layers.2.mlp.experts.w13", rows=(a, b))
    w2 = ck.read("model.layers.2.mlp.experts.w2", rows=(a, b))
    assert w13.shape[0] == w2.shape[0] == b - a
    for i, e in enumerate(range(a, b)):
        p = f"model.layers.2.mlp.experts.{e}."
        assert torch.equal(w13[i], torch.cat([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]]))
        assert torch.equal(w2[i], hf[p + "down_proj.weight"])


def test_reads_only_the_requested_bytes_plus_the_header(tiny):
    _, ck_dir = tiny
    ck = Checkpoint(ck_dir)
    name = "model.layers.2.mlp.experts.w13"
    file = os.path.join(ck_dir, ck.meta(name).parts[0].file)
    header = 8 + int.from_bytes(open(file, "rb").read(8), "little")
    ck.read(name, rows=(0, 0))  # opens the file: its header is all that is read
    assert ck.bytes_read == header
    probe = rchar()
    overhead = rchar() - probe  # reading /proc/self/io counts itself
    before = rchar()
    t = ck.read(name, rows=(2, 5))
    read = rchar() - before - overhead
    want = t.numel() * t.element_size()
    assert read == want, (read, want)  # the kernel's count: nothing but the three experts' bytes
    assert ck.bytes_read == header + want
    assert want < os.path.getsize(file) / 2


def test_rows_outside_the_tensor_are_refused(tiny):
    _, ck_dir = tiny
    with pytest.raises(Exception, match=r"rows \[6, 9\) are outside 'model.layers.2.mlp.experts.w2'"):
        Checkpoint(ck_dir).read("model.layers.2.mlp.experts.w2", rows=(6, 9))
