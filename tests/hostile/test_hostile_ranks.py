"""A rank that dies, or a run that is interrupted, under real torchrun agents: the other ranks end
promptly, say which rank died while doing what, and leave nothing behind.

Run as a script, this file is the worker torchrun starts (`worker`).
"""

from __future__ import annotations

import itertools
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multiproc import free_port

REPO = Path(__file__).resolve().parents[2]
# Short, so that the tests are quick; the ranks in a step (sleeping) for longer than this must
# still count as alive.
PEER_TIMEOUT_S = 3
# How soon after a peer's death every other rank must have ended.
DEATH_BOUND_S = 60
# How soon after Ctrl-C every rank must have ended.
INTERRUPT_BOUND_S = 10


def worker(work: Path, out: str, phase: str) -> None:
    """One rank: records its pid, then calibrates (an all-reduce loop that never ends; with phase
    "oom", rank 1 runs out of memory between two all-reduces), or writes an output: rank 0 makes
    the partial output and waits in a guard for the others, which are still busy with an earlier
    step, outside any guard, for ever."""
    import torch

    from eprt.parallel import ParallelState, fail_together, write_together

    with ParallelState.from_env() as state:
        (work / f"rank-{state.rank}.pid").write_text(f"{os.getpid()} {os.getppid()}")
        if phase in ("calibrate", "oom"):
            with fail_together(state, "calibrating"):
                total = torch.zeros(1)
                for step in itertools.count():
                    state.all_reduce(total)
                    time.sleep(0.05)
                    if phase == "oom" and state.rank == 1 and step == 20:
                        raise MemoryError()
        if state.rank != 0:
            (work / f"rank-{state.rank}.busy").write_text("")
            while True:
                time.sleep(0.1)
        write_together(state, out, lambda tmp: Path(tmp, "rank-0").write_text("written"))


def _torchrun(work: Path, phase: str, port: int, nnodes: int, nproc: int, log: str) -> subprocess.Popen:
    """A torchrun agent in its own process group (as a terminal would start it)."""
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "EPRT_PEER_TIMEOUT": str(PEER_TIMEOUT_S),
        "CUDA_VISIBLE_DEVICES": "",
        "OMP_NUM_THREADS": "1",
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        __file__,
        str(work),
        str(work / "out"),
        phase,
    ]
    with open(work / log, "w") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=work, start_new_session=True)


def _wait_for(paths: list[Path], agents: list[subprocess.Popen], partial: bool = False, timeout: float = 120) -> None:
    """Until every path exists (and, with `partial`, rank 0 has made the partial output)."""
    work = paths[0].parent
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths) or (partial and not _left_behind(work, [])[0]):
        if any(a.poll() is not None for a in agents) or time.monotonic() > deadline:
            raise AssertionError(f"the ranks did not get there: {_logs(work)}")
        time.sleep(0.1)


def _listening(port: int) -> bool:
    import socket

    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _ranks(work: Path, world: int) -> dict[int, tuple[int, int]]:
    """rank -> (its pid, its agent's pid)."""
    return {r: tuple(map(int, (work / f"rank-{r}.pid").read_text().split())) for r in range(world)}


def _ended_within(agents: list[subprocess.Popen], seconds: float) -> float:
    start = time.monotonic()
    for a in agents:
        try:
            a.wait(max(0.1, start + seconds - time.monotonic()))
        except subprocess.TimeoutExpired:
            pass
    return time.monotonic() - start


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie has ended; only its parent has yet to reap it.
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _logs(work: Path) -> str:
    return "\n".join(f"--- {p.name}:\n{p.read_text()[-6000:]}" for p in sorted(work.glob("*.log")))


def _left_behind(work: Path, pids: list[int]) -> tuple[list[str], list[int]]:
    files = sorted(p.name for p in work.iterdir() if not p.name.endswith((".log", ".pid", ".busy")))
    return files, [pid for pid in pids if _alive(pid)]


def _two_nodes(work: Path, phase: str, agents: list, nproc: int = 1) -> int:
    """Two torchrun agents of `nproc` ranks each, as on two nodes; the first serves the run's
    store. Returns the agent pid that serves it."""
    port = free_port()
    agents.append(_torchrun(work, phase, port, 2, nproc, "node-a.log"))
    deadline = time.monotonic() + 60
    while not _listening(port):  # the store is up before the second agent looks for it
        assert agents[0].poll() is None and time.monotonic() < deadline, _logs(work)
        time.sleep(0.1)
    agents.append(_torchrun(work, phase, port, 2, nproc, "node-b.log"))
    return agents[0].pid


@pytest.mark.timeout(180)
def test_rank_killed_on_the_other_node(tmp_path, agents):
    """Rank 2, on the node that does not serve the store, is killed while rank 0 waits for it
    in a guard (ranks 1 and 3 busy outside one): rank 0 names it, removes the partial output and
    ends, and every other rank ends with it."""
    _two_nodes(tmp_path, "write", agents, nproc=2)
    _wait_for([tmp_path / "rank-0.pid"] + [tmp_path / f"rank-{r}.busy" for r in (1, 2, 3)], agents, partial=True)
    ranks = _ranks(tmp_path, 4)
    assert ranks[0][1] == ranks[1][1] == agents[0].pid, "ranks 0, 1 run under the agent serving the store"
    # The others spend longer in their step than the peer timeout: busy, not dead.
    time.sleep(PEER_TIMEOUT_S + 1)
    assert agents[0].poll() is None and agents[1].poll() is None, _logs(tmp_path)
    os.kill(ranks[2][0], signal.SIGKILL)
    took = _ended_within(agents, DEATH_BOUND_S)

    logs = _logs(tmp_path)
    assert took < DEATH_BOUND_S, logs
    node_a = (tmp_path / "node-a.log").read_text()
    # Rank 3 may be named too: its agent ends it once rank 2 has died.
    report = re.search(
        r"error \(rank 0 of 4\): ranks? 2(, 3)? died while preparing the output: no heartbeat "
        rf"for {PEER_TIMEOUT_S} s",
        node_a,
    )
    # The report is what ends rank 0, not a traceback of leaving the run.
    assert report and "DistStoreError" not in node_a, logs
    assert _left_behind(tmp_path, [p for pair in ranks.values() for p in pair]) == ([], []), logs


@pytest.mark.timeout(180)
def test_rank_killed_on_the_node_serving_the_store(tmp_path, agents):
    """Rank 0, on the node whose agent serves the store, is killed while calibrating: its agent
    ends and takes the store with it; rank 1 names rank 0 and ends."""
    _two_nodes(tmp_path, "calibrate", agents)
    _wait_for([tmp_path / "rank-0.pid", tmp_path / "rank-1.pid"], agents)
    ranks = _ranks(tmp_path, 2)
    assert ranks[0][1] == agents[0].pid, "rank 0 runs under the agent that serves the store"
    time.sleep(1)
    os.kill(ranks[0][0], signal.SIGKILL)
    took = _ended_within(agents, DEATH_BOUND_S)

    logs = _logs(tmp_path)
    assert took < DEATH_BOUND_S, logs
    node_b = (tmp_path / "node-b.log").read_text()
    assert "rank 0 could not be heard from while calibrating" in node_b or "rank 0 died while calibrating" in node_b, (
        logs
    )
    assert "rank 1 failed" not in node_b, logs
    assert _left_behind(tmp_path, [p for pair in ranks.values() for p in pair]) == ([], []), logs


@pytest.mark.timeout(120)
def test_ctrl_c_ends_every_rank_and_removes_the_partial_output(tmp_path, agents):
    """Ctrl-C on a torchrun of two ranks while rank 0 waits in a guard with the partial output
    made and rank 1 is busy outside one: every rank ends within seconds, the partial output gone."""
    agents.append(_torchrun(tmp_path, "write", free_port(), 1, 2, "torchrun.log"))
    _wait_for([tmp_path / "rank-0.pid", tmp_path / "rank-1.busy"], agents, partial=True)
    ranks = _ranks(tmp_path, 2)
    os.killpg(agents[0].pid, signal.SIGINT)
    took = _ended_within(agents, INTERRUPT_BOUND_S)

    logs = _logs(tmp_path)
    assert took < INTERRUPT_BOUND_S, logs
    assert _left_behind(tmp_path, [p for pair in ranks.values() for p in pair]) == ([], []), logs
    # each rank says one line, naming the signal, and no traceback of its own (torchrun's agent
    # prints its own on SIGINT, from torch's code)
    for rank in range(2):
        assert logs.count(f"(rank {rank} of 2)") == 1, logs
        assert f"interrupted (rank {rank} of 2): stopped by SIGINT" in logs, logs
    assert f'File "{REPO}/eprt/' not in logs and "test_hostile_ranks.py" not in logs, logs


if __name__ == "__main__":
    from eprt.cli import run

    run(lambda: worker(Path(sys.argv[1]), sys.argv[2], sys.argv[3]))
