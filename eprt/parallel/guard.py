"""Fail together: a step that fails on one rank raises on every rank, naming that rank.

    with fail_together(state, "loading the checkpoint"):
        weights = read_my_slice(...)

Every rank runs the step, then posts its outcome (ok, or the exception's type and message) to
the run's store and reads everyone's. If any rank failed, every rank raises the same
`RankFailure`; on a failing rank it is chained to the original exception, whose traceback
stays visible there.

The outcomes travel through the store, not a process group, so they get through even when the
step's own collectives are stuck or broken. The guard cannot pull a rank out of a collective a
failing peer never joins (a forward that raises on one rank before an all-to-all the others are
in) by itself; the collective's wait does (`ParallelState.finish`), as soon as the failing rank
has posted its outcome, and the rank then posts that it gave up (or, for a collective not waited
for so, its timeout) as its outcome, which the verdict lists apart from the failure that caused
it. The guard waits twice the collective timeout for outcomes; a rank that has posted none by
then (hung outside any collective) is named as missing. A rank that dies is named as soon as its
heartbeat stops (`eprt.parallel.liveness`, EPRT_PEER_TIMEOUT seconds), and a collective that
broke because it did (gloo's "Connection closed by peer") counts, like a timeout, as a
consequence rather than a cause. When the store itself is gone (the node serving it went down),
every rank decides alone and names the others as unreachable. A rank that SIGTERM ends (torchrun's agent ends the other ranks of its node as
soon as one dies) names the peers whose heartbeat has stopped, a few beats after the signal,
rather than the signal. A step that runs out of memory says so, and the way out.

The first rank to decide writes the verdict once (compare-and-set) and every rank obeys it, so
a rank that posts after the others gave up on it raises the same error they did.
"""

from __future__ import annotations

import json
from datetime import timedelta

import torch.distributed as dist

from eprt.errors import EprtError
from eprt.parallel.liveness import HOW_RANKS_DIE, Interrupted, PeerLost, begin_stopping, name_ranks, post, wait_posted
from eprt.parallel.state import ParallelState

# A failure report keeps the exception's type and message, not its traceback (that stays on the
# failing rank); this bounds what one report puts in the store.
MAX_REPORT_CHARS = 2000


class RankFailure(EprtError):
    """A guarded step failed on some rank; raised alike on every rank.

    `failures` maps each rank whose step raised to "ExceptionType: message"; `timeouts` the ranks
    that then timed out (or lost their connection) in a collective waiting for them; `missing`
    lists the live ranks that posted no outcome within `waited_s` seconds; `dead` the ranks whose
    heartbeat had stopped for `silent_s` before they posted one, or, with `store_lost`, the
    ranks this one could not hear from once the run's store stopped answering; `stopped` the
    ranks a signal ended (Ctrl-C, or torchrun's agent ending the other ranks of a failed node).
    `ranks` are the ranks to look at first.
    """

    def __init__(
        self,
        what: str,
        failures: dict[int, str],
        timeouts: dict[int, str] | None = None,
        missing: list[int] = (),
        waited_s: float = 0.0,
        dead: list[int] = (),
        silent_s: float = 0.0,
        store_lost: bool = False,
        stopped: dict[int, str] | None = None,
    ):
        self.what, self.failures = what, dict(failures)
        self.timeouts, self.missing, self.waited_s = dict(timeouts or {}), list(missing), waited_s
        self.dead, self.silent_s, self.store_lost = list(dead), silent_s, store_lost
        self.stopped = dict(stopped or {})
        super().__init__(self._message())

    def __reduce__(self):
        return type(self), (
            self.what,
            self.failures,
            self.timeouts,
            self.missing,
            self.waited_s,
            self.dead,
            self.silent_s,
            self.store_lost,
            self.stopped,
        )

    @property
    def ranks(self) -> list[int]:
        return (
            sorted(self.failures)
            or sorted(self.dead)
            or sorted(self.missing)
            or sorted(self.stopped)
            or sorted(self.timeouts)
        )

    def _message(self) -> str:
        lines = []
        by_report: dict[str, list[int]] = {}
        for r in sorted(self.failures):
            by_report.setdefault(self.failures[r], []).append(r)
        if len(by_report) == 1:  # one rank, or every failing rank saying the same
            ((report, ranks),) = by_report.items()
            lines.append(f"{name_ranks(ranks)} failed while {self.what}: {report}")
        elif by_report:
            lines.append(f"ranks {_names(self.failures)} failed while {self.what}:")
            lines += [f"  {name_ranks(ranks)}: {report}" for report, ranks in by_report.items()]
        if self.dead and self.store_lost:
            lines.append(
                f"{name_ranks(self.dead)} could not be heard from while {self.what}: the run's "
                "store stopped answering (the node serving it, with torchrun's first agent "
                "or rank 0, went down)"
            )
        elif self.dead:
            lines.append(
                f"{name_ranks(self.dead)} died while {self.what}: no heartbeat for "
                f"{self.silent_s:g} s ({HOW_RANKS_DIE})"
            )
        if self.missing:
            lines.append(
                f"{name_ranks(self.missing)} did not report within {self.waited_s:.0f} s while "
                f"{self.what} (hung outside a collective)"
            )
        if self.stopped:
            when = "then" if self.failures or self.missing or self.dead else f"while {self.what}"
            lines.append(
                f"{name_ranks(self.stopped)} {when} stopped on a signal "
                f"({', '.join(sorted(set(self.stopped.values())))})"
            )
        if self.timeouts:
            first = min(self.timeouts)
            caused = self.failures or self.missing or self.dead or self.stopped
            when = "then" if caused else f"while {self.what}"
            lines.append(
                f"{name_ranks(self.timeouts)} {when} timed out waiting in a collective, or lost "
                f"a peer there (rank {first}: {self.timeouts[first]})"
            )
        return "\n".join(lines)


class fail_together:
    """Context manager: run a per-rank step whose failure on any rank raises on every rank.

    Every rank must enter the same guards in the same order. Guards nest: a RankFailure from an
    inner guard, already raised on every rank, passes through the outer ones unchanged.
    `timeout` is how long to wait for the other ranks' outcomes (default: twice the state's
    collective timeout).
    """

    def __init__(self, state: ParallelState, what: str, timeout: timedelta | None = None):
        self.state, self.what = state, what
        self.wait = 2 * state.timeout if timeout is None else timeout

    def __enter__(self) -> fail_together:
        self.state.guards_entered += 1
        self.key = f"guard/{self.state.guards_entered}"
        self.state.open_guards.append(self.key)
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.state.open_guards.remove(self.key)
        if isinstance(exc, RankFailure):
            return False
        try:
            return self._conclude(exc)
        except RankFailure:
            begin_stopping()  # the run ends on it: no signal may replace it
            raise

    def _conclude(self, exc: BaseException | None) -> bool:
        state = self.state
        if state.world == 1 or state.store is None:
            if exc is not None:
                raise RankFailure(self.what, {state.rank: _describe(exc)}) from exc
            return False
        outcome = "" if exc is None else _kind(exc) + _describe(exc)
        if exc is not None and not isinstance(exc, Exception):
            # An interrupt or exit: tell the others, but do not hold the user up waiting for them.
            told = _try(lambda: post(state.store, self.key, state.rank, outcome.encode()))
            if not (isinstance(exc, Interrupted) and exc.signal == "SIGTERM"):
                return False
            if told:
                verdict = _signalled(state, outcome)
                if verdict is None:  # every peer beats: the stop was asked for, and goes on
                    return False
                self._fail(verdict, exc)
            # SIGTERM with the store gone: torchrun's agent ending its workers because the node
            # serving the store went down, which is the cause to name, not the signal
            state.peers_lost = True
            verdict = _alone(state, outcome)
            raise RankFailure(self.what, {}, dead=verdict["dead"], store_lost=True, stopped=verdict["stopped"]) from exc
        try:
            verdict = _decide(state, self.key, outcome, self.wait)
        except Interrupted as stop:
            # SIGTERM in the wait: torchrun's agent ending this rank because a peer died
            if stop.signal != "SIGTERM":
                raise
            verdict = _signalled(state, outcome)
            if verdict is None:
                raise
        if any(verdict[kind] for kind in ("failures", "timeouts", "missing", "dead", "stopped")):
            self._fail(verdict, exc)
        return False

    def _fail(self, verdict: dict, exc: BaseException | None) -> None:
        """Raise the verdict's RankFailure on this rank."""
        if verdict["dead"] or verdict["store_lost"]:
            self.state.peers_lost = True
        silent_s = verdict.get("silent_s") or (self.state.heartbeat.timeout_s if self.state.heartbeat else 0.0)
        raise RankFailure(
            self.what,
            verdict["failures"],
            verdict["timeouts"],
            verdict["missing"],
            self.wait.total_seconds(),
            verdict["dead"],
            silent_s,
            verdict["store_lost"],
            verdict["stopped"],
        ) from exc


def _decide(state: ParallelState, key: str, outcome: str, wait: timedelta) -> dict:
    """Post this rank's outcome ("" ok, "F..." failed, "T..." timed out in a collective, "S..."
    stopped on a signal), read everyone's, and return the verdict the first deciding rank wrote."""
    store, world = state.store, state.world
    keys = [f"{key}/{r}" for r in range(world)]
    verdict = {"failures": {}, "timeouts": {}, "stopped": {}, "missing": [], "dead": [], "store_lost": False}
    try:
        post(store, key, state.rank, outcome.encode())
        try:
            behind, verdict["dead"] = wait_posted(store, key, list(range(world)), state.heartbeat, wait)
        except Interrupted as stop:
            # SIGTERM in the wait with the store gone: torchrun's agent ending this rank because
            # the node serving the store went down before this rank's next poll found it gone
            if stop.signal != "SIGTERM" or _try(lambda: store.check([f"{key}/count"])):
                raise
            return _alone(state, outcome)
        # After a death, the live ranks behind are not late: they have not got here yet.
        verdict["missing"] = [] if verdict["dead"] else behind
        posted = [r for r in range(world) if r not in behind + verdict["dead"]]
        for r, value in zip(posted, store.multi_get([keys[r] for r in posted])):
            kind, report = value[:1].decode(), value[1:].decode()
            if kind:
                verdict[_VERDICT_OF[kind]][r] = report
        decided = store.compare_set(f"{key}/verdict", "", json.dumps(verdict))
        # The last reader clears the guard's keys; a dead rank never reads.
        if store.add(f"{key}/read", 1) == world - len(verdict["dead"]):
            for k in keys + [f"{key}/count", f"{key}/verdict", f"{key}/read"]:
                store.delete_key(k)
    except dist.DistError:
        return _alone(state, outcome)
    decided = json.loads(decided)
    for kind in _VERDICT_OF.values():
        decided[kind] = {int(r): report for r, report in decided[kind].items()}
    return decided


def _signalled(state: ParallelState, outcome: str) -> dict | None:
    """The verdict of a rank SIGTERM is ending: the peers whose heartbeat stays still a few beats
    (`Heartbeat.fallen_silent`) died first, and torchrun's agent is ending this rank for it; None
    when every peer still beats."""
    if state.heartbeat is None:
        return None
    try:
        dead = state.heartbeat.fallen_silent()
    except dist.DistError:
        return _alone(state, outcome)
    if not dead:
        return None
    verdict = {
        "failures": {},
        "timeouts": {},
        "stopped": {state.rank: "SIGTERM"},
        "missing": [],
        "dead": dead,
        "store_lost": False,
        "silent_s": state.heartbeat.signalled_silence_s,
    }
    if outcome[:1] in ("F", "T"):
        verdict[_VERDICT_OF[outcome[0]]][state.rank] = outcome[1:]
    return verdict


def _alone(state: ParallelState, outcome: str) -> dict:
    """The verdict from this rank's outcome alone, for when the store cannot be reached."""
    verdict = {
        "failures": {},
        "timeouts": {},
        "stopped": {},
        "missing": [],
        "store_lost": True,
        "dead": [r for r in range(state.world) if r != state.rank],
    }
    if outcome:
        verdict[_VERDICT_OF[outcome[0]]][state.rank] = outcome[1:]
    return verdict


# Outcome kinds, as posted, and where the verdict lists them.
_VERDICT_OF = {"F": "failures", "T": "timeouts", "S": "stopped"}


def _kind(exc: BaseException) -> str:
    if isinstance(exc, KeyboardInterrupt):
        return "S"
    return "T" if _is_timeout(exc) else "F"


def _describe(exc: BaseException) -> str:
    message = str(exc)[:MAX_REPORT_CHARS]
    described = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    if _out_of_memory(exc):
        return (
            f"ran out of memory ({described}); use more ranks (a larger --ep) or more memory per "
            "rank, and tell the plan what a rank may use (--max-memory)"
        )
    return described


def _out_of_memory(exc: BaseException) -> bool:
    """Python's MemoryError, or torch's failed allocation (CPU: "not enough memory", CUDA: "out of
    memory"; a C++ allocation: "bad_alloc")."""
    message = str(exc).lower()
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError)
        and any(
            words in message for words in ("out of memory", "not enough memory", "can't allocate memory", "bad_alloc")
        )
    )


def _is_timeout(exc: BaseException) -> bool:
    """A collective that gave up waiting for a peer (gloo says "Timed out", NCCL's watchdog
    "timeout", eprt's wait PeerLost) or lost it (gloo: "Connection closed by peer", "Connection
    reset by peer"), as opposed to a failure of the step itself."""
    message = str(exc).lower()
    return (
        isinstance(exc, PeerLost)
        or (
            isinstance(exc, RuntimeError)
            and any(words in message for words in ("timed out", "closed by peer", "reset by peer"))
        )
        or (isinstance(exc, dist.DistBackendError) and "timeout" in message)
    )


def _try(op) -> bool:
    try:
        op()
        return True
    except dist.DistError:
        return False


def _names(ranks) -> str:
    return ", ".join(map(str, sorted(ranks)))
