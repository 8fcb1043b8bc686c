"""Where the order of the ranks' file operations matters, the work directory waits on the host, through
the run's store: on NCCL a collective's wait returns at once on the host, so an all_reduce orders
nothing. The ranks here run on gloo with `finish` made NCCL-like (it returns at once)."""

import math
import os
import time

import pytest
import torch

import eprt.parallel.state as state_module
from eprt.errors import ConfigError
from eprt.parallel import ParallelState
from eprt.parallel.barrier import host_barrier
from eprt.parallel.liveness import PeerLost, collective_timeout_s
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.sequences import LayerState
from eprt.quant.run.workdir import WorkDir
from tests.multiproc import run_world

LATE_S = 1.0  # how late rank 1 is with each file operation


def nccl_like(tmp):
    """Rank 1 writes and removes its files late; once a save is finished (by the next save, or at the
    end of the layers) and once the files are removed, every rank checks what the others must have
    done by then, and waits for them to have looked before it goes on."""
    ParallelState.finish = lambda self, work: None  # the host goes on at once, as on NCCL
    with ParallelState.from_env() as state:
        work = WorkDir(str(tmp), state, {"run": 1})
        work.prepare(False)
        host_barrier(state, "prepared")
        if state.rank == 1:
            write, remove = WorkDir._write, os.remove
            WorkDir._write = lambda self, *a: time.sleep(LATE_S) or write(self, *a)
        cal = Calibrator(None, [], kv=False)
        ls = LayerState(torch.zeros(2, 3, 4), [])
        seen = []

        def look(path):
            seen.append(sorted(os.listdir(path)))
            # a peer goes on to remove its files once its save is finished: not before this rank looked
            host_barrier(state, f"looked {len(seen)}")

        with work.saving():
            for layer in range(2):
                work.save(layer, ls, cal)  # finishes the save of the layer before
                if layer:
                    look(tmp / f"rank-{1 - state.rank:05d}")
        look(tmp / f"rank-{1 - state.rank:05d}")
        if state.rank == 1:
            WorkDir._write = write
            os.remove = lambda path: time.sleep(LATE_S / 4) or remove(path)
        work.remove()
        seen.append(sorted(os.listdir(tmp)))
        return seen


def test_the_work_directory_orders_its_files_on_the_host(tmp_path):
    rank0, rank1 = run_world(nccl_like, 2, tmp_path, timeout=60)
    for seen in (rank0, rank1):
        # a save is finished once the peer's file of that layer is written (its older one may be there still)
        assert all(f"layer-{layer:05d}.safetensors" in seen[layer] for layer in range(2))
    # rank 0 removes the marker (and the directory's last entries) only after rank 1 removed its files
    assert rank0[2] == [] and f"rank-{0:05d}" not in rank1[2]


class Beat:
    """A heartbeat whose peer 1 dies after `alive` looks."""

    interval, timeout_s = 0.01, 1.0

    def __init__(self, alive: int):
        self.alive = alive

    def dead(self):
        self.alive -= 1
        return [1] if self.alive < 0 else []


class Store:
    """The run's store with no rank failing."""

    def add(self, key, n):
        return 0


class Collective:
    """A collective as NCCL's host sees it: `wait` returns at once, `is_completed` after `polls` looks."""

    def __init__(self, polls: float):
        self.polls, self.waited = polls, False

    def wait(self, *_):
        self.waited = True

    def is_completed(self):
        self.polls -= 1
        return self.polls < 0


def test_on_nccl_finish_returns_once_the_collective_completed(monkeypatch):
    aborted = []
    monkeypatch.setattr(state_module, "abort_communicators", lambda: aborted.append(True))
    state = ParallelState(world=2, backend="nccl", heartbeat=Beat(alive=100), store=Store())
    work = Collective(polls=5)
    state.finish(work)
    assert work.waited and work.polls < 0 and not aborted and not state.abandoned


def test_on_nccl_a_lost_peer_aborts_the_collective(monkeypatch):
    aborted = []
    monkeypatch.setattr(state_module, "abort_communicators", lambda: aborted.append(True))
    state = ParallelState(world=2, backend="nccl", heartbeat=Beat(alive=3), store=Store())
    with pytest.raises(PeerLost, match="rank 1 died: no heartbeat for 1 s .*rank 0 aborted the collective"):
        state.finish(Collective(polls=math.inf))
    assert aborted == [True] and state.abandoned


def test_the_collective_timeout_is_the_users(monkeypatch):
    monkeypatch.setenv("EPRT_COLLECTIVE_TIMEOUT", "42")
    assert collective_timeout_s() == 42.0
    monkeypatch.setenv("EPRT_COLLECTIVE_TIMEOUT", "ten minutes")
    with pytest.raises(
        ConfigError, match="EPRT_COLLECTIVE_TIMEOUT='ten minutes' is not a number of seconds from 0.5 to 86400"
    ):
        collective_timeout_s()
