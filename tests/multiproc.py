"""Run a function on a world of CPU processes, with torchrun's environment, for multi-rank tests.

    results = run_world(fn, world, *args, timeout=60)   # [fn(*args) on rank 0, on rank 1, ...]

`fn` must be a module-level function (it is pickled by reference). A rank that raises fails
the call with that rank's traceback; a world still running at `timeout` is killed and fails
the call naming the ranks that never finished.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import socket
import time
import traceback

import torch.multiprocessing as mp

# Once one rank has failed, the others get this long to finish (they may be waiting out a
# collective timeout) before they are killed.
GRACE_S = 15.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(fn, world: int, *args, timeout: float = 60.0) -> list:
    # A forkserver that has imported torch once starts each rank in a fraction of the time a
    # fresh interpreter takes, and unlike a plain fork it holds no threads or locks to inherit.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "eprt.parallel"])
    port = free_port()
    procs, pending = [], {}
    for rank in range(world):
        recv, send = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, args=(fn, rank, world, port, args, send), daemon=True)
        proc.start()
        send.close()
        procs.append(proc)
        pending[recv] = rank

    results, errors = {}, {}
    start = time.monotonic()
    deadline = start + timeout
    try:
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for conn in multiprocessing.connection.wait(list(pending), timeout=left):
                rank = pending.pop(conn)
                try:
                    ok, value = conn.recv()
                except EOFError:
                    procs[rank].join(1)
                    ok, value = False, f"exited with code {procs[rank].exitcode} and no result\n"
                (results if ok else errors)[rank] = value
                if not ok:
                    deadline = min(deadline, time.monotonic() + GRACE_S)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
            proc.join(5)

    if errors or pending:
        report = [f"--- rank {r} failed:\n{errors[r]}" for r in sorted(errors)]
        hung = sorted(pending.values())
        if hung:
            report.append(f"--- ranks {hung} had not finished after {time.monotonic() - start:.0f} s and were killed")
        raise AssertionError(f"world of {world} failed:\n" + "\n".join(report))
    return [results[r] for r in range(world)]


def _rank_main(fn, rank: int, world: int, port: int, args, conn) -> None:
    # The multi-rank tests run on gloo over CPU processes, even where a GPU is present.
    os.environ.update(
        CUDA_VISIBLE_DEVICES="",
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    import torch

    torch.set_num_threads(1)
    try:
        conn.send((True, fn(*args)))
    except BaseException:
        conn.send((False, traceback.format_exc()))
    finally:
        conn.close()
