"""The process groups of one run, built once from torchrun's environment.

The world factors as edp x ep for the routed experts, ep innermost (Megatron's order): with
world 8 and ep 4 the ep groups are [0-3], [4-7] and the edp groups [0,4], [1,5], [2,6], [3,7].
Rank r of an ep group holds the r-th block of E/ep experts (`ParallelState.placement`); the edp
group of a rank is the set of ranks holding the same experts. The dense part is data parallel over the whole world.

Beside the process groups, every rank keeps a client of the run's key-value store.
The fail-together guard reports outcomes through it, so a report still gets through when a
process group is stuck or broken by a timed-out collective. Every rank also beats a heartbeat
there (`eprt.parallel.liveness`), so that no wait on a rank that died outlasts the peer timeout,
and turns SIGINT and SIGTERM into an exception, so that an interrupted run cleans up after itself.

Collectives go through `all_reduce` and `all_to_all_single`, which wait for them the way a guard
waits for outcomes: a rank waiting in one gives it up (`PeerLost`) once a peer has died, or has
failed or stopped its step (posted a failure to a guard this rank is in, or left the run failing),
instead of waiting the collective's own timeout for a peer that never comes. A process group with
a collective given up is never torn down: tearing it down waits out that collective's timeout.
"""

from __future__ import annotations

import ctypes
import os
import socket
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from eprt.errors import ConfigError
from eprt.parallel.liveness import (
    DEFAULT_COLLECTIVE_TIMEOUT_S,
    FIRST_POLL_S,
    HOW_RANKS_DIE,
    PEER_TIMEOUT_ENV,
    Heartbeat,
    PeerLost,
    collective_timeout_s,
    install_signal_handlers,
    name_ranks,
    peer_timeout_s,
    post,
    restore_signal_handlers,
    stopping,
    wait_posted,
)
from eprt.parallel.placement import ExpertPlacement

DEFAULT_TIMEOUT = timedelta(seconds=DEFAULT_COLLECTIVE_TIMEOUT_S)
# The least time a rank gives rank 0 to serve the run's store without torchrun's agent: ranks
# of a manual launch start seconds apart.
MIN_JOIN_S = 5.0
# What gloo raises when a timed wait for a collective ends before the collective does.
_POLL_EXPIRED = "Operation timed out!"


def valid_ep(world: int, num_experts: int | None = None) -> list[int]:
    """The ep degrees a world of this size can run: divisors of the world (and of the expert count)."""
    return [ep for ep in range(1, world + 1) if world % ep == 0 and (num_experts is None or num_experts % ep == 0)]


def check_ep(world: int, ep: int, num_experts: int | None = None) -> None:
    """Refuse an ep degree that does not divide the world, or the routed-expert count."""
    if ep < 1 or world % ep:
        raise ConfigError(
            f"ep={ep} does not divide the world size {world}; "
            f"valid ep for world {world}: {', '.join(map(str, valid_ep(world)))}"
        )
    if num_experts is not None and num_experts % ep:
        raise ConfigError(
            f"ep={ep} does not divide the {num_experts} routed experts; valid ep for world "
            f"{world} and {num_experts} experts: {', '.join(map(str, valid_ep(world, num_experts)))}"
        )


def expert_groups(world: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """(ep groups, edp groups) of the (edp, ep) factorization of `world`, ep innermost."""
    check_ep(world, ep)
    ep_groups = [list(range(start, start + ep)) for start in range(0, world, ep)]
    edp_groups = [list(range(ep_rank, world, ep)) for ep_rank in range(ep)]
    return ep_groups, edp_groups


def rank_coords(rank: int, world: int, ep: int) -> tuple[int, int]:
    """(edp_rank, ep_rank) of a global rank: its place in its edp group and in its ep group."""
    check_ep(world, ep)
    return rank // ep, rank % ep


@dataclass
class ParallelState:
    """Where this rank sits in the run, and the process groups it communicates over.

    Build it with `from_env` (under torchrun, or any launcher that sets torchrun's variables) or
    `single` (one process, no process group). Groups are None in a world of one.
    """

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    ep_size: int = 1
    ep_rank: int = 0
    edp_size: int = 1
    edp_rank: int = 0
    ep_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's ep group, in ep-rank order
    edp_ranks: tuple[int, ...] = (0,)  # global ranks of this rank's edp group
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    backend: str | None = None  # "nccl" with CUDA, "gloo" without; None in a world of one
    timeout: timedelta = DEFAULT_TIMEOUT
    ep_group: dist.ProcessGroup | None = None
    edp_group: dist.ProcessGroup | None = None
    dp_group: dist.ProcessGroup | None = None  # the whole world
    store: dist.Store | None = field(default=None, repr=False)
    guards_entered: int = field(default=0, repr=False)  # names each guard's keys in the store
    barriers_entered: int = field(default=0, repr=False)  # names each host barrier's keys (eprt.parallel.barrier)
    heartbeat: Heartbeat | None = field(default=None, repr=False)
    peers_lost: bool = field(default=False, repr=False)  # a guard found a rank dead, or the store gone
    open_guards: list[str] = field(default_factory=list, repr=False)  # the keys of the guards this rank is in
    abandoned: bool = field(default=False, repr=False)  # a collective was given up (PeerLost)
    _signal_handlers: dict | None = field(default=None, repr=False)  # to restore on close

    @classmethod
    def single(cls, device: torch.device | str | None = None) -> ParallelState:
        """A world of one process: every group is trivial, and nothing is initialized."""
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(device=torch.device(device))

    @classmethod
    def from_env(
        cls, ep: int | None = None, num_experts: int | None = None, timeout: timedelta | None = None
    ) -> ParallelState:
        """Join the run torchrun describes in RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
        MASTER_ADDR and MASTER_PORT, and build the groups of an (edp, ep) layout.

        `ep` defaults to the world size. With `num_experts`, an ep that does not divide the
        routed-expert count is refused too; every rank does that arithmetic alike, so every rank
        refuses before any connection is made. Devices are refused (`check_devices`) on every
        rank once the ranks have exchanged what they see. `timeout` (default EPRT_COLLECTIVE_TIMEOUT
        seconds, 600) bounds every collective, NCCL's through its watchdog, and the wait of every
        guard (see `eprt.parallel.guard`); EPRT_PEER_TIMEOUT (seconds, default 30) how long a rank
        may go without a heartbeat before the others give up on it.
        """
        timeout = timeout or timedelta(seconds=collective_timeout_s())
        world = int(os.environ.get("WORLD_SIZE", "1"))
        rank = int(os.environ.get("RANK", "0"))
        local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        ep = world if ep is None else ep
        check_ep(world, ep, num_experts)
        peer_timeout = peer_timeout_s()
        if world == 1:
            return cls.single(torch.device("cuda", local_rank) if torch.cuda.is_available() else "cpu")
        try:
            addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
        except KeyError as e:
            raise ConfigError(
                f"WORLD_SIZE={world} but {e.args[0]} is not set; launch with torchrun, which sets it"
            ) from None

        # torchrun's agent already serves a store at MASTER_ADDR:MASTER_PORT (a fresh one for
        # each restart); without an agent, rank 0 serves it.
        agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        tcp_store = _join_store(addr, port, world, rank, rank == 0 and not agent_store, timeout, peer_timeout)
        store = dist.PrefixStore("eprt", tcp_store)
        # The heartbeat's own client (Store.clone is newer than the torch we support).
        beat_store = dist.TCPStore(addr, port, is_master=False, timeout=timeout, wait_for_workers=False)
        heartbeat = Heartbeat(store, dist.PrefixStore("eprt", beat_store), rank, world, peer_timeout)
        signal_handlers = install_signal_handlers()
        try:
            device = _bind_device(store, rank, world, local_rank, local_world, timeout)
            backend = "nccl" if device.type == "cuda" and not ranks_share_gpu() else "gloo"
            dist.init_process_group(
                backend,
                store=dist.PrefixStore("eprt_pg", tcp_store),
                rank=rank,
                world_size=world,
                timeout=timeout,
                device_id=device if backend == "nccl" else None,
            )

            ep_groups, edp_groups = expert_groups(world, ep)
            # new_group is collective over the world: every rank creates every group, in one order.
            for ranks in ep_groups:
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    ep_group, ep_ranks = group, tuple(ranks)
            for ranks in edp_groups:
                group = dist.new_group(ranks, timeout=timeout)
                if rank in ranks:
                    edp_group, edp_ranks = group, tuple(ranks)
        except BaseException:  # a refusal, or a rank that never came: no heartbeat outlives the attempt
            heartbeat.stop()
            restore_signal_handlers(signal_handlers)
            raise
        edp_rank, ep_rank = rank_coords(rank, world, ep)
        return cls(
            rank=rank,
            world=world,
            local_rank=local_rank,
            ep_size=ep,
            ep_rank=ep_rank,
            edp_size=world // ep,
            edp_rank=edp_rank,
            ep_ranks=ep_ranks,
            edp_ranks=edp_ranks,
            device=device,
            backend=backend,
            timeout=timeout,
            ep_group=ep_group,
            edp_group=edp_group,
            dp_group=dist.group.WORLD,
            store=store,
            heartbeat=heartbeat,
            _signal_handlers=signal_handlers,
        )

    def check_experts(self, num_experts: int) -> None:
        """Refuse, alike on every rank, a layer whose routed experts do not split over ep."""
        check_ep(self.world, self.ep_size, num_experts)

    def placement(self, num_experts: int) -> ExpertPlacement:
        """Where this rank's routed experts, and every expert's owner, are in this layout."""
        self.check_experts(num_experts)
        return ExpertPlacement(num_experts, self.ep_size, self.ep_rank, self.edp_size, self.edp_rank)

    def all_reduce(
        self, tensor: torch.Tensor, over: str = "dp", op: dist.ReduceOp.RedOpType = dist.ReduceOp.MAX
    ) -> torch.Tensor:
        """Reduce `tensor` in place over the "dp" (world), "ep" or "edp" group; a no-op alone."""
        size, group = self._group(over)
        if size > 1:
            self.finish(dist.all_reduce(tensor, op=op, group=group, async_op=True))
        return tensor

    def all_to_all_single(
        self,
        out: torch.Tensor,
        x: torch.Tensor,
        out_splits: list[int] | None = None,
        in_splits: list[int] | None = None,
        over: str = "dp",
    ) -> torch.Tensor:
        """`dist.all_to_all_single` over the "dp", "ep" or "edp" group, waited for by `finish`."""
        self.finish(dist.all_to_all_single(out, x, out_splits, in_splits, group=self._group(over)[1], async_op=True))
        return out

    def _group(self, over: str) -> tuple[int, dist.ProcessGroup | None]:
        return {
            "dp": (self.world, self.dp_group),
            "ep": (self.ep_size, self.ep_group),
            "edp": (self.edp_size, self.edp_group),
        }[over]

    def finish(self, work: dist.Work) -> None:
        """Wait for a collective this rank has started (`async_op=True`); raise PeerLost, and give
        it up, once a peer has died or has failed or stopped its step.

        gloo's timed wait leaves the collective running, so this rank looks at its peers between
        waits of one heartbeat. NCCL's wait returns at once on the host (the device's stream waits),
        so the host polls the collective's completion instead, looking at its peers between polls;
        once one is lost it aborts the communicators (NCCL's own way out of a collective that will
        not complete) before it gives up. So on either backend a collective has completed on every
        rank when `finish` returns."""
        if self.heartbeat is None:
            work.wait()
            return
        if self.backend == "nccl":
            self._finish_nccl(work)
            return
        beat = timedelta(seconds=self.heartbeat.interval)
        while True:
            try:
                work.wait(beat)
                return
            except RuntimeError as e:
                if str(e) != _POLL_EXPIRED:
                    raise
            lost = self.peer_lost()
            if lost:
                self.abandoned = True
                raise PeerLost(f"{lost}; rank {self.rank} gave up waiting for it in a collective")

    def _finish_nccl(self, work: dist.Work) -> None:
        work.wait()
        pause = FIRST_POLL_S
        while not work.is_completed():
            lost = self.peer_lost()
            if lost:
                self.abandoned = True
                abort_communicators()
                raise PeerLost(f"{lost}; rank {self.rank} aborted the collective it waited for")
            time.sleep(pause)
            pause = min(2 * pause, self.heartbeat.interval)

    def peer_lost(self) -> str | None:
        """Why no collective can complete any more: a peer died, or failed or stopped its step;
        None while every peer may still come."""
        dead = self.heartbeat.dead()
        if dead:
            return f"{name_ranks(dead)} died: no heartbeat for {self.heartbeat.timeout_s:g} s ({HOW_RANKS_DIE})"
        for key in self.open_guards:
            # A guard's outcome that is not empty is a failure, a timeout or a signal.
            if int(self.store.add(f"{key}/count", 0)):
                failed = [
                    r for r in range(self.world) if self.store.check([f"{key}/{r}"]) and self.store.get(f"{key}/{r}")
                ]
                if failed:
                    return f"{name_ranks(failed)} failed or stopped its step"
        if int(self.store.add("failing/count", 0)):
            return "a rank is leaving the run on a failure"
        return None

    def close(self, failing: bool = False) -> None:
        """Leave the run: wait for every live rank, then tear the process groups down.

        Without torchrun's agent, rank 0 serves the store, so it leaves last: a rank still
        talking to the store when rank 0 exits would fail. The wait gives up on ranks that die,
        is skipped once a guard has found one dead (or the store gone), and lasts at most the
        peer timeout while an error or a signal (`failing`) is already ending the run; it then
        never raises, so that the error that ends the run is the one reported.
        """
        if self.world == 1 or self.store is None:
            return
        failing = failing or stopping()
        try:
            if failing:  # a peer still waiting in a collective for this rank gives it up
                post(self.store, "failing", self.rank)
            if not self.peers_lost:
                self._leave_together(failing)
        except dist.DistError:
            if not failing:
                raise
        finally:
            if self.heartbeat is not None:
                self.heartbeat.stop()
            if not stopping():  # a stopping process keeps ignoring repeated signals to the end
                restore_signal_handlers(self._signal_handlers)
            if self.abandoned:
                _keep_to_the_end(self.ep_group, self.edp_group, self.dp_group)
            elif dist.is_initialized():
                dist.destroy_process_group()
            self.store = None

    def _leave_together(self, failing: bool) -> None:
        wait = timedelta(seconds=self.heartbeat.timeout_s) if failing and self.heartbeat else self.timeout
        post(self.store, "close/arrived", self.rank)
        wait_posted(self.store, "close/arrived", list(range(self.world)), self.heartbeat, wait)
        if self.rank == 0:
            wait_posted(self.store, "close/left", list(range(1, self.world)), self.heartbeat, wait)
        else:
            post(self.store, "close/left", self.rank)

    def __enter__(self) -> ParallelState:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(failing=exc is not None)


def abort_communicators() -> None:
    """Abort every NCCL communicator of this process, so that no kernel waits on for a lost peer
    (torch's experimental call: where this torch lacks it, the watchdog's timeout ends the wait)."""
    abort = getattr(dist.distributed_c10d, "_abort_process_group", None)
    if abort is not None:
        try:
            abort()
        except (RuntimeError, ValueError):
            pass


def _join_store(
    addr: str, port: int, world: int, rank: int, serve: bool, timeout: timedelta, peer_timeout: float
) -> dist.TCPStore:
    """The run's store at addr:port: served by this rank (`serve`), or joined.

    A port another program holds is refused by name. A rank that cannot join within twice the peer
    timeout (at least MIN_JOIN_S) gives up: rank 0 never served the store, or what answers at the
    port is not it. Ranks of a manual launch (srun starting every rank) must therefore start within
    that of rank 0: time for a node to import torch from a shared file system. The client is made on a thread of its own, since one that reached something
    other than a store waits for its answer for ever."""
    if serve:
        try:
            return dist.TCPStore(addr, port, world, is_master=True, timeout=timeout, wait_for_workers=False)
        except dist.DistNetworkError as e:
            if "EADDRINUSE" not in str(e):
                raise
            raise ConfigError(
                f"rank 0 cannot serve the run's store on port {port} (MASTER_ADDR={addr}, "
                f"MASTER_PORT={port}): the port is already in use, by another run or program; "
                "launch again with a free MASTER_PORT"
            ) from None
    join_s = max(2 * peer_timeout, MIN_JOIN_S)
    joined: list = []

    def join() -> None:
        try:
            joined.append(
                dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=join_s), wait_for_workers=False)
            )
        except dist.DistError as e:
            joined.append(e)

    thread = threading.Thread(target=join, name=f"eprt-join-{rank}", daemon=True)
    thread.start()
    thread.join(join_s + 1)
    if not joined or isinstance(joined[0], dist.DistError):
        raise ConfigError(
            f"rank {rank} could not reach the run's store at {addr}:{port} (MASTER_ADDR, MASTER_PORT) "
            f"within {join_s:g} s: rank 0 serves it there, so check that rank 0 started, and that "
            f"MASTER_PORT {port} is free for it; ranks that start further apart need a larger "
            f"{PEER_TIMEOUT_ENV}"
        )
    joined[0].set_timeout(timeout)
    return joined[0]


def _keep_to_the_end(*groups: dist.ProcessGroup | None) -> None:
    """Never tear `groups` down: one with a collective given up would wait, tearing down or at
    the process's exit, for that collective's own timeout (minutes) before the process may end."""
    for group in groups:
        if group is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))


def check_devices(reports: list[tuple[int, int, str]]) -> None:
    """Refuse a world whose ranks cannot each own a GPU, or that mixes GPU and CPU ranks.

    reports[r] = (GPUs visible to rank r, ranks on its node, its host name). Two ranks on one
    GPU would share its memory and serialize its work; ranks with and without CUDA cannot share
    a backend.
    """
    without = [str(r) for r, (count, _, _) in enumerate(reports) if count == 0]
    if without and len(without) < len(reports):
        raise ConfigError(
            f"ranks {', '.join(without)} see no CUDA device while the others do; run every "
            "rank with a GPU, or every rank without one (CUDA_VISIBLE_DEVICES=)"
        )
    for count, local_world, host in reports:
        if count and local_world > count:
            raise ConfigError(
                f"{local_world} ranks run on host {host}, which has {count} visible GPUs, and two "
                f"ranks cannot share one; run at most {count} processes per node "
                "(--nproc-per-node) or expose more GPUs in CUDA_VISIBLE_DEVICES"
            )


def _bind_device(
    store: dist.Store, rank: int, world: int, local_rank: int, local_world: int, timeout: timedelta
) -> torch.device:
    """This rank's device, GPU `local_rank` or the CPU, once every rank's report passes
    `check_devices` (each rank checks all reports, so every rank refuses alike)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    store.set(f"device/{rank}", f"{count} {local_world} {socket.gethostname()}")
    store.wait([f"device/{r}" for r in range(world)], timeout)
    reports = []
    for r in range(world):
        c, lw, host = store.get(f"device/{r}").decode().split(" ", 2)
        reports.append((int(c), int(lw), host))
    if not ranks_share_gpu():
        check_devices(reports)
    if not count:
        return torch.device("cpu")
    gpu = local_rank % count
    torch.cuda.set_device(gpu)
    return torch.device("cuda", gpu)


def ranks_share_gpu() -> bool:
    """EPRT_RANKS_SHARE_GPU=1: the ranks of a node take its GPUs in turn, several on one, over gloo,
    which takes CUDA tensors too: every multi-rank path runs on CUDA tensors on a machine of one GPU
    (the GPU check's layouts step). Slow (gloo copies through the host, and the ranks share the
    GPU's memory and time): a check, never a run's setting."""
    return os.environ.get("EPRT_RANKS_SHARE_GPU") == "1"
