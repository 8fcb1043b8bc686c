"""Worker threads for CPU work that splits into independent pieces (a weight's row chunks, the
experts of a matmul call), with torch's own intra-op threads at 1 meanwhile.

Each piece runs whole on one thread, so its bits do not depend on how many workers there are:
torch's intra-op threads would split a single operation by the thread count (the CPU's
reductions and the BLAS's small matmuls follow the split to the last bit) and meet after every
operation, which on a busy machine costs more than it saves. Elsewhere than on CPU, pieces run
in order on the calling thread.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, Iterator, TypeVar

import torch

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_workers = 1
_PREFIX = "eprt-cpu"


@contextlib.contextmanager
def cpu_workers(workers: int) -> Iterator[None]:
    """Within: CPU pieces run on `workers` threads, and every torch operation on one thread."""
    global _pool, _workers
    threads = torch.get_num_threads()
    pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix=_PREFIX) if workers > 1 else None
    torch.set_num_threads(1)
    _pool, _workers = pool, max(1, workers)
    try:
        yield
    finally:
        _pool, _workers = None, 1
        torch.set_num_threads(threads)
        if pool is not None:
            pool.shutdown()


def worker_count(device: torch.device) -> int:
    """How many threads `for_each` spreads pieces on `device` over (1 on a worker itself, where
    they run in order)."""
    return _workers if device.type == "cpu" and not _on_worker() else 1


def _on_worker() -> bool:
    return threading.current_thread().name.startswith(_PREFIX)


def for_each(
    pieces: Iterable[T], buffers: Callable[[], object], body: Callable[[T, object], None], device: torch.device
) -> None:
    """body(piece, bufs) for every piece, with `bufs` from buffers() reused from piece to piece:
    in order here, or on the workers of `cpu_workers`, each with buffers of its own. The pieces
    must write disjoint outputs; a worker's exception is raised here once all have stopped."""
    pieces = list(pieces)
    # a piece that itself splits runs its parts in order: its worker must not wait on the pool
    if _pool is None or device.type != "cpu" or len(pieces) < 2 or _on_worker():
        bufs = buffers()
        for piece in pieces:
            body(piece, bufs)
        return
    todo = iter(pieces)  # shared: each worker takes the next piece left (one step under the GIL)
    # torch's grad and inference modes are the thread's own: the workers take the caller's
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def work() -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            bufs = buffers()
            for piece in todo:
                body(piece, bufs)

    futures = [_pool.submit(work) for _ in range(min(_workers, len(pieces)))]
    for f in futures:
        f.exception()  # wait for every worker before raising any one's error
    for f in futures:
        f.result()
