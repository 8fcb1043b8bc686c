"""What one process of the model-free export holds at its peak, from the plan alone: the process
itself, the output tensors produced ahead of the writing (eprt.hf.export.PRODUCE_AHEAD_BYTES), and
the largest piece of work, one at a time: a quantized Linear's weight as read (an expert's whole
entry of a stack, and a copy of it where the stack is stored in another order), with what its
format holds quantizing it (`WeightFormat.export_working_bytes`, and under mse its search's) and
the weights of the Linears sharing its per-tensor scale (read for their amax), or a tensor decoded
from the source's encoding. A carried tensor stored as it is written is copied by the kernel and
holds nothing. Each of `workers` processes holds this much; they hold nothing of each other's."""

from __future__ import annotations

import math
from dataclasses import dataclass

from eprt.hf.export import PRODUCE_AHEAD_BYTES
from eprt.hf.streaming.plan import Carried
from eprt.quant.run.process_memory import current_rss
from eprt.units import format_bytes


@dataclass(frozen=True)
class MemoryPlan:
    process: int
    ahead: int
    largest: int
    largest_name: str
    workers: int

    @property
    def peak(self) -> int:
        """Of one process."""
        return self.process + self.ahead + self.largest

    def summary(self) -> str:
        return (
            f"peaks at {format_bytes(self.peak)} (process {format_bytes(self.process)}, {self.largest_name} "
            f"{format_bytes(self.largest)}, output produced ahead {format_bytes(self.ahead)}); "
            f"{format_bytes(self.peak * self.workers)} for the {self.workers}"
        )


def plan_memory(stream, workers: int, process: int | None = None) -> MemoryPlan:
    """The memory plan of `stream` (eprt.hf.streaming.run.Stream) on `workers` processes, each holding
    `process` bytes before it starts (default: this process's resident set)."""
    src, plan = stream.src, stream.plan
    held = [(0, "nothing")]
    for item in plan.items:
        if isinstance(item, Carried):
            t = src.tensors[item.source]
            if t.encoded is not None:
                held.append((t.nbytes, f"{item.name} decoded"))
            continue
        x, fmt = item.linear, item.format
        elements = math.prod(x.shape)
        itemsize = src.tensors[x.source].dtype.itemsize
        per_element = itemsize + fmt.export_working_bytes + (fmt.export_mse_working_bytes if item.mse else 0)
        # one expert of a stack is read whole (gate and up, where the Linear is one of them); where the
        # stack is stored otherwise (transposed, interleaved) it is read as a view in eprt's order,
        # which the format's arithmetic copies once
        entry = math.prod(src.tensors[x.source].shape[1:]) * itemsize if x.index is not None else 0
        entry *= 2 if x.source in src.permuted else 1
        group = sum(math.prod(g.shape) for g in plan.groups[x.group]) * itemsize if fmt.weight_scale_leaf else 0
        search = fmt.mse_search_bytes(x.shape[1]) if item.mse else 0
        working = math.ceil(elements * per_element) + 2 * group + fmt.export_worker_bytes + search
        held.append((working + entry, f"{x.name}"))
    largest, name = max(held)
    rss = process if process is not None else current_rss()
    return MemoryPlan(rss, PRODUCE_AHEAD_BYTES, largest, f"{name} quantized", workers)
