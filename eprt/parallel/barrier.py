"""A barrier on the host, through the run's key-value store, for where the order of the ranks' file
operations matters.

An all_reduce is no barrier on NCCL: its `wait` only makes the device's stream wait, and the host goes
on at once, so a rank that removes a file after "every rank has written" may remove it before they
have. Every rank posts its arrival at a barrier in the store and waits for every other's, between
waits of one poll looking for a peer that died, failed or stopped its step, as a collective's wait
does (`ParallelState.finish`): then it raises PeerLost rather than waiting for a rank that never comes.
"""

from __future__ import annotations

from datetime import timedelta

from eprt.parallel.liveness import POLL_S, PeerLost, post, wait_posted
from eprt.parallel.state import ParallelState


def host_barrier(state: ParallelState, name: str) -> None:
    """Return once every rank of the world has reached this barrier (`name`: what it orders, for the
    store's keys). Every rank calls it alike, in the same order; a no-op in a world of one."""
    if state.world == 1 or state.store is None:
        return
    state.barriers_entered += 1
    key = f"barrier/{state.barriers_entered}/{name}"
    post(state.store, key, state.rank)
    everyone = list(range(state.world))
    waited = timedelta()
    while True:
        behind, dead = wait_posted(state.store, key, everyone, state.heartbeat, timedelta(seconds=POLL_S))
        if not behind and not dead:
            return
        lost = state.peer_lost() if state.heartbeat is not None else None
        if lost:
            raise PeerLost(f"{lost}; rank {state.rank} gave up waiting for it at the barrier of {name}")
        waited += timedelta(seconds=POLL_S)
        if waited > state.timeout:
            raise PeerLost(
                f"ranks {behind} did not reach the barrier of {name} within the collective timeout "
                f"({state.timeout.total_seconds():g} s); rank {state.rank} gave up waiting"
            )
