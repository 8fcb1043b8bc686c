"""Reading the next decoder layer while this one computes.

On a GPU rank the host is idle while a layer computes, and reading the next layer (from disk, with
its source encoding decoded) takes as long as a layer's compute at real size: so once a layer is
placed on the device, one host thread reads the next layer's share of this rank into host memory,
and the engine places those tensors when it gets there instead of reading them then. The layer's
bytes, and so the run's, do not change. The host holds one layer's share more (the memory plan's
host term `ahead`). On a CPU rank the host is the device, and its cores compute: no read ahead.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
from torch import nn

from eprt.loading.resolved import ResolvedCheckpoint


class ReadAhead:
    """One layer read ahead on a thread of its own, by its prefix; `take` waits for it."""

    def __init__(self, rc: ResolvedCheckpoint, model: nn.Module, names: list[str]):
        self.rc, self.model, self.names = rc, model, names
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="eprt-read-ahead")
        self.pending: dict[str, Future] = {}

    def start(self, prefix: str) -> None:
        """Begin reading the tensors named `prefix*` (a no-op for one already begun)."""
        if prefix not in self.pending:
            self.pending[prefix] = self.pool.submit(self._read, prefix)

    def take(self, prefix: str) -> dict[str, torch.Tensor] | None:
        """The tensors of `prefix` as read ahead (raising what the read raised), or None where it was not."""
        future = self.pending.pop(prefix, None)
        return None if future is None else future.result()

    def _read(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {}
        for name in (n for n in self.names if n.startswith(prefix)):
            module, _, attr = name.rpartition(".")
            out[name] = self.rc.read(name, getattr(self.model.get_submodule(module), attr))
        return out

    def close(self) -> None:
        """Drop what was read and not taken (a run that ends early), once the thread is done."""
        for future in self.pending.values():
            future.cancel()
        self.pool.shutdown(wait=True)
        self.pending.clear()

    def __enter__(self) -> ReadAhead:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
