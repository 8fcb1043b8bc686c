"""A layer boundary's save is written on a thread of its own while the next layer computes: from a copy
of what it saves, with its error raised on the main thread by name."""

import os
import re
import threading

import pytest
import torch
from safetensors.torch import load_file

import eprt.quant.run.workdir as workdir
from eprt.errors import EprtError
from eprt.parallel import ParallelState
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.sequences import LayerState
from eprt.quant.run.workdir import WorkDir


def work_dir(tmp_path) -> WorkDir:
    work = WorkDir(str(tmp_path / "work"), ParallelState.single("cpu"), {"run": 1})
    work.prepare(False)
    return work


def test_a_save_is_written_while_the_next_layer_changes_the_hidden_states(tmp_path, monkeypatch):
    work, cal = work_dir(tmp_path), Calibrator(None, [], kv=False)
    released, waited = threading.Event(), []
    write = WorkDir._write

    def held_back(self, *a):  # the write waits until the next layer has changed the hidden states
        waited.append(released.wait(timeout=30))
        write(self, *a)

    monkeypatch.setattr(WorkDir, "_write", held_back)
    hidden = torch.arange(24, dtype=torch.float32).reshape(2, 3, 4)
    ls = LayerState(hidden.clone(), [hidden[:, :1].clone()])
    with work.saving():
        work.save(0, ls, cal)
        ls.hidden.add_(100)  # the next layer, in place, before the write
        ls.blocks[0].zero_()
        released.set()
        work.finish()
        files = os.listdir(work.mine)
        saved = load_file(os.path.join(work.mine, "layer-00000.safetensors"))
        work.save(1, ls, cal)  # finishes nothing: the save before it is finished already
    assert waited == [True, True]  # each save returned before its write began
    assert files == ["layer-00000.safetensors"]
    assert set(saved) == {"hidden", "block.0"}  # as they were when saved
    assert torch.equal(saved["hidden"], hidden) and torch.equal(saved["block.0"], hidden[:, :1])
    assert os.listdir(work.mine) == ["layer-00001.safetensors"]  # the older one dropped once it was finished
    saved = load_file(os.path.join(work.mine, "layer-00001.safetensors"))
    assert torch.equal(saved["hidden"], hidden + 100) and torch.equal(saved["block.0"], torch.zeros(2, 1, 4))


def test_an_error_of_the_writer_is_raised_on_the_main_thread_naming_the_file(tmp_path, monkeypatch):
    work, cal = work_dir(tmp_path), Calibrator(None, [], kv=False)

    def refused(*_):
        raise RuntimeError("the device went away")

    monkeypatch.setattr(workdir, "save_tensors", refused)
    path = os.path.join(work.mine, "layer-00000.safetensors")
    with pytest.raises(EprtError, match=re.escape(path) + ": saving layer 0 .* failed: RuntimeError: the device went"):
        with work.saving():
            work.save(0, LayerState(torch.zeros(2, 3, 4), []), cal)  # returns: the write fails later
    assert os.listdir(work.mine) == []  # the half-written file is gone
    assert work.writer is None  # the writer's thread has ended


def test_a_run_stopped_during_a_write_keeps_the_save(tmp_path):
    """A layer stopped while the save before it is written: the save completes and, in a world of one,
    is the only layer file left, as --resume expects."""
    work, cal = work_dir(tmp_path), Calibrator(None, [], kv=False)
    with pytest.raises(KeyboardInterrupt):
        with work.saving():
            work.save(0, LayerState(torch.zeros(2, 3, 4), []), cal)
            work.save(1, LayerState(torch.ones(2, 3, 4), []), cal)
            raise KeyboardInterrupt
    assert os.listdir(work.mine) == ["layer-00001.safetensors"]
    assert torch.equal(load_file(os.path.join(work.mine, "layer-00001.safetensors"))["hidden"], torch.ones(2, 3, 4))
