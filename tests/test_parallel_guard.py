import json
import os
import pickle
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from eprt.errors import CheckpointError
from eprt.parallel import ParallelState, RankFailure, fail_together
from tests.multiproc import run_world

# The collective timeout of the fault worlds: a rank stuck in a collective raises after this.
TIMEOUT_S = 5


def read_shard(path):
    """A stand-in for a checkpoint read that refuses a corrupt file."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path.name} is corrupt ({e}); re-run the conversion") from e


def _outcome(state, what, step, **kwargs):
    """Run `step` under a guard: ("ok", value) or ("RankFailure", message, ranks, seconds, cause)."""
    start = time.monotonic()
    try:
        with fail_together(state, what, **kwargs):
            return "ok", step()
    except RankFailure as e:
        cause = type(e.__cause__).__name__ if e.__cause__ is not None else None
        return "RankFailure", str(e), e.ranks, time.monotonic() - start, cause


def _faults(tmp):
    state = ParallelState.from_env(timeout=timedelta(seconds=TIMEOUT_S))
    rank = state.rank
    out = {"ok": _outcome(state, "reading the config", lambda: rank * 10)}

    out["read"] = _outcome(state, "loading the checkpoint", lambda: read_shard(tmp / f"shard-{rank}.json"))

    def two_fail():
        if rank in (0, 3):
            raise ValueError(f"bad tensor on rank {rank}")

    out["two"] = _outcome(state, "checking tensors", two_fail)

    def nested():
        with fail_together(state, "building layer 3"):
            if rank == 2:
                raise MemoryError("out of memory")

    out["nested"] = _outcome(state, "building the model", nested)

    # Rank 1 raises before an all-to-all the others are already in: they leave it by its
    # timeout, and every rank names rank 1.
    def forward():
        if rank == 1:
            raise ValueError("activation is NaN on rank 1")
        got = torch.empty(state.world)
        dist.all_to_all_single(got, torch.full((state.world,), float(rank)))
        return got.tolist()

    out["forward"] = _outcome(state, "running the forward", forward)

    # Rank 3 is slow to post: the others give up on it, and it then obeys their verdict.
    def slow():
        if rank == 3:
            time.sleep(3)

    out["missing"] = _outcome(state, "writing the output", slow, timeout=timedelta(seconds=1))
    state.close()
    return out


@pytest.mark.timeout(90)
def test_fail_together(tmp_path):
    for rank in range(4):
        (tmp_path / f"shard-{rank}.json").write_text('{"ok": 1}' if rank != 2 else '{"ok": 1')
    start = time.monotonic()
    results = run_world(_faults, 4, tmp_path, timeout=60)
    assert time.monotonic() - start < 60

    for rank, out in enumerate(results):
        assert out["ok"] == ("ok", rank * 10)

        kind, message, ranks, _, cause = out["read"]
        assert (kind, ranks) == ("RankFailure", [2])
        assert message.startswith(
            "rank 2 failed while loading the checkpoint: CheckpointError: shard-2.json is corrupt"
        )
        assert cause == ("CheckpointError" if rank == 2 else None)

        kind, message, ranks, _, cause = out["two"]
        assert ranks == [0, 3]
        assert message == (
            "ranks 0, 3 failed while checking tensors:\n"
            "  rank 0: ValueError: bad tensor on rank 0\n"
            "  rank 3: ValueError: bad tensor on rank 3"
        )

        kind, message, ranks, _, cause = out["nested"]
        assert message == (
            "rank 2 failed while building layer 3: ran out of memory (MemoryError: out of "
            "memory); use more ranks (a larger --ep) or more memory per rank, and tell the "
            "plan what a rank may use (--max-memory)"
        )

        kind, message, ranks, seconds, cause = out["forward"]
        assert ranks == [1] and seconds < 2 * TIMEOUT_S + 5
        first, *rest = message.split("\n")
        assert first == "rank 1 failed while running the forward: ValueError: activation is NaN on rank 1"
        assert rest[0].startswith(
            "ranks 0, 2, 3 then timed out waiting in a collective, or lost a peer there (rank 0: "
        )
        assert cause == ("ValueError" if rank == 1 else "RuntimeError")

        kind, message, ranks, seconds, cause = out["missing"]
        assert ranks == [3]
        assert message == "rank 3 did not report within 1 s while writing the output (hung outside a collective)"
    # Every rank raised the same error.
    for case in ("read", "two", "nested", "forward", "missing"):
        assert len({out[case][1] for out in results}) == 1, case


def _busy_rank(seconds):
    """Rank 1 spends `seconds`, several peer timeouts, in one step while rank 0 waits for it."""
    os.environ["EPRT_PEER_TIMEOUT"] = "1"
    with ParallelState.from_env(timeout=timedelta(seconds=30)) as state:
        return _outcome(state, "calibrating", lambda: time.sleep(seconds if state.rank == 1 else 0))


@pytest.mark.timeout(90)
def test_a_busy_rank_is_not_dead():
    """Heartbeats come from a thread of their own: a step far longer than the peer timeout is
    waited for, not taken for a death."""
    for kind, *rest in run_world(_busy_rank, 2, 4, timeout=60):
        assert kind == "ok", rest


def test_fail_together_single_process():
    state = ParallelState.single("cpu")
    with fail_together(state, "reading the config"):
        pass
    with pytest.raises(RankFailure, match="rank 0 failed while reading the config: KeyError: 'x'") as info:
        with fail_together(state, "reading the config"):
            {}["x"]
    assert isinstance(info.value.__cause__, KeyError)
    e = pickle.loads(pickle.dumps(info.value))
    assert str(e) == str(info.value) and e.ranks == [0]


def test_identical_reports_read_as_one_line():
    from eprt.parallel.guard import RankFailure

    same = RankFailure("writing the output", {0: "OutputExistsError: out exists", 1: "OutputExistsError: out exists"})
    assert str(same) == "ranks 0, 1 failed while writing the output: OutputExistsError: out exists"
    mixed = RankFailure("loading", {0: "E: a", 2: "E: b", 3: "E: a"})
    assert str(mixed).splitlines() == ["ranks 0, 2, 3 failed while loading:", "  ranks 0, 3: E: a", "  rank 2: E: b"]


def _store_served_elsewhere():
    """A run's store served by another process (as torchrun's first agent serves it), and a
    client of it."""
    import subprocess
    import sys

    from tests.multiproc import free_port

    port = free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            (
                "import time, datetime, torch.distributed as dist\n"
                f"s = dist.TCPStore('127.0.0.1', {port}, is_master=True, timeout=datetime.timedelta(seconds=30))\n"
                "time.sleep(600)\n"
            ),
        ]
    )
    deadline = time.monotonic() + 30
    while True:
        try:
            return server, dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=2))
        except dist.DistError:
            if time.monotonic() > deadline:
                server.kill()
                raise


@pytest.mark.parametrize("store_goes", [True, False])
def test_sigterm_while_waiting_names_the_cause(monkeypatch, store_goes):
    """torchrun's agent sends SIGTERM to rank 1 while it waits in a guard for rank 0. When the store
    went down with rank 0's node first (the agent's reason), the guard names rank 0 and the lost
    store; when the store still answers, the signal is the user's stop and goes on as one."""
    from eprt.parallel import guard
    from eprt.parallel.liveness import Interrupted

    server, store = _store_served_elsewhere()
    try:

        def wait_until_signalled(*args):
            if store_goes:
                server.kill()
                server.wait()
            raise Interrupted("SIGTERM")

        monkeypatch.setattr(guard, "wait_posted", wait_until_signalled)
        state = ParallelState(rank=1, world=2, store=store)
        with pytest.raises((RankFailure, Interrupted)) as info:
            with fail_together(state, "calibrating"):
                raise RuntimeError("Connection closed by peer")
        if store_goes:
            assert isinstance(info.value, RankFailure) and state.peers_lost
            assert str(info.value).splitlines() == [
                "rank 0 could not be heard from while calibrating: the run's store stopped answering "
                "(the node serving it, with torchrun's first agent or rank 0, went down)",
                "rank 1 then timed out waiting in a collective, or lost a peer there "
                "(rank 1: RuntimeError: Connection closed by peer)",
            ]
            assert isinstance(info.value.__cause__, RuntimeError)
        else:
            assert type(info.value) is Interrupted and not state.peers_lost
    finally:
        server.kill()
        server.wait()
