"""A GPU rank reads the next decoder layer on a host thread while a layer computes; the run's bytes do
not change. (On a GPU it is on by itself; here it is asked for.)"""

import threading

from eprt.hf.convert import convert_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.layouts.test_ptq import same_files


def test_the_next_layer_is_read_ahead_and_the_bytes_are_the_same(tmp_path, monkeypatch):
    hf = make_tiny("deepseek_v3", str(tmp_path / "hf"), num_hidden_layers=4, source_format="fp8-block")
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)

    def args(out):
        return PTQArgs(ck, "nvfp4", str(tmp_path / out), calib_size=6, seq_len=24, group_tokens=48, progress=False)

    run_ptq(ParallelState.single("cpu"), args("plain"))
    readers: dict[int, set[str]] = {}  # decoder layer -> the threads that read its tensors
    read = ResolvedCheckpoint.read

    def spying(self, name, slot, device=None):
        if ".layers." in name and "mtp" not in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            readers.setdefault(layer, set()).add(threading.current_thread().name.split("_")[0])
        return read(self, name, slot, device)

    monkeypatch.setattr(ResolvedCheckpoint, "read", spying)
    monkeypatch.setattr(LayerEngine, "read_ahead", True)
    run_ptq(ParallelState.single("cpu"), args("ahead"))
    # layer 0 is read when the run starts; each later one ahead, while the layer before it computes
    assert readers[0] >= {"MainThread"}
    assert all("eprt-read-ahead" in readers[i] for i in (1, 2, 3)), readers
    same_files(str(tmp_path / "plain"), str(tmp_path / "ahead"))
