"""Every rank ends within a bounded time, and says which rank, or which port, ended the run.

A rank stopped (SIGSTOP: a hung node, a stalled file system) keeps its sockets open; a rank that
fails between two collectives leaves its peers in the next one; a rank killed under a torchrun
agent makes the agent end the others with SIGTERM; a MASTER_PORT already taken leaves rank 0
without a store and the others without a run. In each case every other rank ends within a few
peer timeouts (EPRT_PEER_TIMEOUT), with one line that names the cause. The ranks are the worker
of tests/hostile/test_hostile_ranks.py, run through eprt's command-line entry, so the lines are the ones
a user reads.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.hostile.test_hostile_ranks import PEER_TIMEOUT_S, REPO, _alive, _logs, _ranks, _torchrun, _wait_for
from tests.multiproc import free_port

WORKER = REPO / "tests" / "hostile" / "test_hostile_ranks.py"
# How soon after the cause every other rank must have ended: the peer timeout to notice a rank
# that went silent, and a little more to agree on the verdict and leave.
BOUND_S = 3 * PEER_TIMEOUT_S
# What starting a Python process that imports torch may take on a loaded machine.
START_S = 30


def _ended_within(pids: list[int], seconds: float) -> list[int]:
    """The pids still running after `seconds`."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _one_agent(work: Path, phase: str, agents: list, nproc: int) -> dict[int, tuple[int, int]]:
    agents.append(_torchrun(work, phase, free_port(), 1, nproc, "torchrun.log"))
    _wait_for([work / f"rank-{r}.pid" for r in range(nproc)], agents)
    time.sleep(1)  # the ranks are in the calibration's all-reduces
    return _ranks(work, nproc)


def _says(work: Path, ranks: list[int], world: int, line: str) -> None:
    """Every rank of `ranks` printed `line`, and no rank a traceback (torchrun's agent prints its
    own when a rank fails: not eprt's)."""
    log = (work / "torchrun.log").read_text()
    for r in ranks:
        assert f"error (rank {r} of {world}): {line}" in log, _logs(work)
    assert f'File "{REPO}/eprt' not in log and f'File "{REPO}/tests' not in log, _logs(work)


@pytest.mark.timeout(120)
def test_a_stopped_rank_is_named_by_every_other_rank(tmp_path, agents):
    """Rank 1 is stopped (SIGSTOP) while the others wait for it in an all-reduce: they name it
    once its heartbeat has been still for the peer timeout, not after the collective's 10 minutes."""
    ranks = _one_agent(tmp_path, "calibrate", agents, 3)
    stopped = ranks[1][0]
    os.kill(stopped, signal.SIGSTOP)
    try:
        survivors = [ranks[0][0], ranks[2][0]]
        assert _ended_within(survivors, BOUND_S) == [], _logs(tmp_path)
        _says(
            tmp_path,
            [0, 2],
            3,
            f"rank 1 died while calibrating: no heartbeat for {PEER_TIMEOUT_S} s "
            "(killed, crashed, out of memory, or its node went down)",
        )
    finally:
        # a stopped rank outlives its agent (torchrun starts each rank in a session of its own)
        os.kill(stopped, signal.SIGKILL)


@pytest.mark.timeout(120)
def test_a_rank_out_of_memory_between_collectives_is_named_with_the_way_out(tmp_path, agents):
    """Rank 1 raises MemoryError between two all-reduces, while rank 0 already waits in the next:
    rank 0 gives that up as soon as rank 1 has reported, and both print rank 1's failure."""
    agents.append(_torchrun(tmp_path, "oom", free_port(), 1, 2, "torchrun.log"))
    start = time.monotonic()
    assert agents[0].wait(START_S + BOUND_S) == 1, _logs(tmp_path)
    assert time.monotonic() - start < START_S + BOUND_S
    _says(
        tmp_path,
        [0, 1],
        2,
        "rank 1 failed while calibrating: ran out of memory (MemoryError); use more "
        "ranks (a larger --ep) or more memory per rank",
    )


@pytest.mark.timeout(120)
def test_a_rank_killed_under_one_agent_is_named_not_the_signal(tmp_path, agents):
    """Rank 1 is killed (as by the OOM killer); its agent then ends ranks 0 and 2 with SIGTERM.
    They name rank 1 as the cause, in one line each, instead of a traceback of the signal."""
    ranks = _one_agent(tmp_path, "calibrate", agents, 3)
    os.kill(ranks[1][0], signal.SIGKILL)
    assert _ended_within([ranks[0][0], ranks[2][0]], BOUND_S) == [], _logs(tmp_path)
    _says(tmp_path, [0, 2], 3, "rank 1 died while calibrating: no heartbeat for ")


@pytest.mark.timeout(120)
def test_a_taken_master_port_is_named_on_every_rank(tmp_path):
    """A manual launch (every rank started with RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) on a
    port another program listens on: rank 0 names the port, and rank 1, which reaches that program
    instead of the run's store, gives up and names it too."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        procs = []
        for rank in range(2):
            env = {
                **os.environ,
                "PYTHONPATH": str(REPO),
                "EPRT_PEER_TIMEOUT": str(PEER_TIMEOUT_S),
                "CUDA_VISIBLE_DEVICES": "",
                "RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_RANK": str(rank),
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(port),
            }
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), str(tmp_path), str(tmp_path / "out"), "calibrate"],
                    env=env,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
        try:
            errors = [p.communicate(timeout=START_S + BOUND_S)[1] for p in procs]
        finally:
            for p in procs:
                p.kill()
    assert [p.returncode for p in procs] == [2, 2], errors
    assert (
        f"error (rank 0 of 2): rank 0 cannot serve the run's store on port {port} (MASTER_ADDR=127.0.0.1, "
        f"MASTER_PORT={port}): the port is already in use"
    ) in errors[0]
    assert f"error (rank 1 of 2): rank 1 could not reach the run's store at 127.0.0.1:{port}" in errors[1]
    assert "Traceback" not in errors[0] + errors[1], errors
