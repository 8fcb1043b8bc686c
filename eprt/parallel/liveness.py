"""Which ranks of a run are still alive, and waits on the other ranks that end when one is not.

Every rank beats a counter in the run's store (`alive/RANK`) from a background thread, so a rank
busy in one long step, or blocked in a collective, still beats. A peer whose counter has not
moved for `EPRT_PEER_TIMEOUT` seconds (default 30), as this rank watches it, is dead: killed,
crashed, or its node is gone. Counters, not timestamps, so that the nodes' clocks need not agree.

`wait_posted` waits for every rank to post a key, and gives up on the ranks that die meanwhile,
so that no wait on a dead rank lasts longer than the peer timeout; a collective is waited for
alike (`ParallelState.finish`), and given up with `PeerLost`.

Signals: SIGINT (Ctrl-C) and SIGTERM (torchrun's agent ending its workers) raise `Interrupted`,
once, so that the guards tell the other ranks and every `finally` removes what it started;
a second signal while that cleanup runs (torchrun forwards Ctrl-C as a second SIGINT) is
ignored rather than cutting the cleanup short, and so is any signal once the rank is failing
(`begin_stopping`): torchrun's agent ends the other ranks as soon as a failed one exits, and the
failure is what each of them must report.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from eprt.errors import ConfigError, EprtError

PEER_TIMEOUT_ENV = "EPRT_PEER_TIMEOUT"
DEFAULT_PEER_TIMEOUT_S = 30.0
# both timeouts: below a beat's round trip through the store (the heartbeat beats every timeout / 5 at most), a
# live peer would be taken for dead; above a day, the store's waits overflow their timedelta
MIN_TIMEOUT_S = 0.5
MAX_TIMEOUT_S = 86400.0
COLLECTIVE_TIMEOUT_ENV = "EPRT_COLLECTIVE_TIMEOUT"
DEFAULT_COLLECTIVE_TIMEOUT_S = 600.0
# How often a wait on other ranks looks at the store again: soon at first, since the ranks of a
# step mostly arrive together and every guard of a run waits once, then less often up to POLL_S.
FIRST_POLL_S = 0.001
POLL_S = 0.25
# A signalled rank names the peers whose heartbeat stays still for this many beats: torchrun's
# agent ends its other ranks at once when one dies, long before the peer timeout.
SIGNALLED_SILENCE_BEATS = 3
# What the dead are: the way a rank dies without a word (the OOM killer is the commonest).
HOW_RANKS_DIE = "killed, crashed, out of memory, or its node went down"


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM arrived: the run is stopping."""

    @property
    def signal(self) -> str:
        """The signal's name: "SIGINT" or "SIGTERM"."""
        return self.args[0]


class PeerLost(EprtError):
    """This rank gave up waiting in a collective: a peer died, or failed or stopped its step, and
    will not join it."""


def peer_timeout_s() -> float:
    """Seconds without a heartbeat after which a peer is dead (env EPRT_PEER_TIMEOUT)."""
    return seconds_from_env(PEER_TIMEOUT_ENV, DEFAULT_PEER_TIMEOUT_S)


def collective_timeout_s() -> float:
    """Seconds a collective may take before its backend gives it up (env EPRT_COLLECTIVE_TIMEOUT):
    gloo's timeout, NCCL's watchdog's. The heartbeat ends a wait on a dead peer sooner; this bounds
    a collective whose peers are alive but never join it."""
    return seconds_from_env(COLLECTIVE_TIMEOUT_ENV, DEFAULT_COLLECTIVE_TIMEOUT_S)


def seconds_from_env(name: str, default: float) -> float:
    text = os.environ.get(name, "")
    if not text:
        return default
    try:
        seconds = float(text)
    except ValueError:
        seconds = math.nan
    if not MIN_TIMEOUT_S <= seconds <= MAX_TIMEOUT_S:  # NaN too
        raise ConfigError(
            f"{name}={text!r} is not a number of seconds from {MIN_TIMEOUT_S:g} to {MAX_TIMEOUT_S:g}; "
            f"unset it for the default of {default:.0f} s"
        )
    return seconds


class Heartbeat:
    """This rank's heartbeat, and its view of every peer's.

    `beat_store` must be a client of its own (a second connection): a long wait of the main thread on its
    client would otherwise hold the heartbeat up.
    """

    def __init__(self, store: dist.Store, beat_store: dist.Store, rank: int, world: int, timeout_s: float):
        self.store, self.rank, self.world, self.timeout_s = store, rank, world, timeout_s
        self._beat_store, self._key = beat_store, f"alive/{rank}"
        # The first beat is posted before the ranks meet, so that every counter exists once
        # they have.
        beat_store.add(self._key, 1)
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._stop = threading.Event()
        self.interval = min(1.0, timeout_s / 5)  # between beats
        self._thread = threading.Thread(target=self._run, name=f"eprt-heartbeat-{rank}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self._beat_store.add(self._key, 1)
            except dist.DistError:
                return  # the store is gone; the main thread finds out at its next wait

    def dead(self, silent_s: float | None = None) -> list[int]:
        """The peers whose heartbeat has not moved for `silent_s` (default: the peer timeout), as
        this rank has watched it (raises DistError when the store cannot be reached)."""
        silent_s = self.timeout_s if silent_s is None else silent_s
        peers = [r for r in range(self.world) if r != self.rank]
        counts = self.store.multi_get([f"alive/{r}" for r in peers])
        now = time.monotonic()
        for r, count in zip(peers, counts):
            if self._seen.get(r, (None,))[0] != count:
                self._seen[r] = (count, now)
        return [r for r in peers if now - self._seen[r][1] > silent_s]

    def fallen_silent(self) -> list[int]:
        """The peers whose heartbeat stays still for SIGNALLED_SILENCE_BEATS beats from now (or
        already had): for a rank that a signal is ending, the peers that died first."""
        silent_s = self.signalled_silence_s
        deadline = time.monotonic() + silent_s + self.interval
        while time.monotonic() < deadline:
            time.sleep(self.interval / 2)
            dead = self.dead(silent_s)
        return dead

    @property
    def signalled_silence_s(self) -> float:
        return SIGNALLED_SILENCE_BEATS * self.interval

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(self.interval + 1)


def name_ranks(ranks) -> str:
    """ "rank 2", or "ranks 0, 3"."""
    return f"{'rank' if len(ranks) == 1 else 'ranks'} {', '.join(map(str, sorted(ranks)))}"


def post(store: dist.Store, prefix: str, rank: int, value: bytes = b"") -> None:
    """Post this rank's `prefix/RANK`, and count it in `prefix/count` (what `wait_posted` polls)."""
    store.set(f"{prefix}/{rank}", value)
    store.add(f"{prefix}/count", 1)


def wait_posted(
    store: dist.Store, prefix: str, ranks: list[int], heartbeat: Heartbeat | None, wait: timedelta
) -> tuple[list[int], list[int]]:
    """Wait until every rank of `ranks` has posted under `prefix`, one that has not is dead, or
    `wait` runs out. Returns (alive ranks that have not posted, dead ranks that have not).
    Raises DistError when the store cannot be reached.

    The first death ends the wait: the live ranks still behind may be busy for long (or stuck
    in a collective with the dead rank), and they learn the outcome when they get here."""
    deadline = time.monotonic() + wait.total_seconds()
    pause = FIRST_POLL_S
    while True:
        # One counter read per poll while all is well; who is behind is looked up only when a
        # peer has died or the wait has run out.
        if int(store.add(f"{prefix}/count", 0)) >= len(ranks):
            return [], []
        dead_peers = heartbeat.dead() if heartbeat is not None else []
        out_of_time = time.monotonic() >= deadline
        if dead_peers or out_of_time:
            pending = [r for r in ranks if not store.check([f"{prefix}/{r}"])]
            dead = [r for r in pending if r in dead_peers]
            if out_of_time or dead:
                return [r for r in pending if r not in dead], dead
        time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
        pause = min(2 * pause, POLL_S)


_stopping = False


def _on_signal(signum, frame) -> None:
    global _stopping
    if _stopping:
        return
    _stopping = True
    raise Interrupted(signal.Signals(signum).name)


def install_signal_handlers() -> dict | None:
    """Turn SIGINT and SIGTERM into `Interrupted`; returns the handlers to restore (None off
    the main thread, where Python cannot set them)."""
    global _stopping
    if threading.current_thread() is not threading.main_thread():
        return None
    _stopping = False
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig in previous:
        signal.signal(sig, _on_signal)
    return previous


def restore_signal_handlers(previous: dict | None) -> None:
    if previous is None or threading.current_thread() is not threading.main_thread():
        return
    for sig, handler in previous.items():
        signal.signal(sig, handler)


def begin_stopping() -> None:
    """This process is ending on a failure: from here on a signal does not cut its cleanup short,
    nor replace the failure it reports."""
    global _stopping
    _stopping = True


def stopping() -> bool:
    """Whether a signal, or a failure (`begin_stopping`), has started stopping this process."""
    return _stopping
