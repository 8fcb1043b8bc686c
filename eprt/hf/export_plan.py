"""What a quantized export holds in memory, planned from the manifest alone: the process, the output
tensors computed ahead of the writing (eprt.hf.export.PRODUCE_AHEAD_BYTES), and the largest weight
being quantized, one tensor at a time: a dense Linear's whole weight, or a batch of routed-expert
rows (eprt.hf.export_quantized.BATCH_ELEMENTS, at least one row a CPU worker). Nothing else stays:
each tensor is read, quantized, written and dropped."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from eprt.hf.export import PRODUCE_AHEAD_BYTES
from eprt.hf.export_quantized import BATCH_ELEMENTS
from eprt.storage.checkpoint import Checkpoint, TensorMeta
from eprt.units import format_bytes

# bytes a weight element being quantized holds besides its value as read: the fp32 quotient
# (value / scale) and its code
WORKING_BYTES = 4 + 1


@dataclass(frozen=True)
class ExportPlan:
    process: int  # bytes the process holds before the export
    ahead: int  # output tensors computed ahead of the writing
    largest: int  # the largest weight (or batch of expert rows) as read and quantized
    largest_name: str

    @property
    def peak(self) -> int:
        return self.process + self.ahead + self.largest

    def summary(self) -> str:
        return (
            f"peaks at {format_bytes(self.peak)} (process {format_bytes(self.process)}, "
            f"{self.largest_name} read and quantized {format_bytes(self.largest)}, "
            f"output computed ahead {format_bytes(self.ahead)})"
        )


def plan_export(ck: Checkpoint, modules: Iterable[str], workers: int, process: int) -> ExportPlan:
    """The plan of exporting `modules` (dense Linears and routed-experts modules) of `ck` quantized,
    on `workers` CPU workers, in a process that holds `process` bytes."""
    held = [(0, "no weight")]
    for m in modules:
        if f"{m}.weight" in ck.tensors:
            meta = ck.tensors[f"{m}.weight"]
            held.append((math.prod(meta.shape) * held_per_weight(meta), f"{m}.weight"))
        for name in (f"{m}.w13", f"{m}.w2"):
            if name in ck.tensors:
                meta = ck.tensors[name]
                row = math.prod(meta.shape[1:])
                rows = min(meta.shape[0], max(workers, BATCH_ELEMENTS // max(1, row)))
                held.append((rows * row * held_per_weight(meta), f"{rows} expert rows of {name}"))
    largest, name = max(held)
    return ExportPlan(process, PRODUCE_AHEAD_BYTES, largest, name)


def held_per_weight(meta: TensorMeta) -> int:
    return meta.dtype.itemsize + WORKING_BYTES
