"""What a quantized export holds in memory, planned from the manifest alone: the process, the output
tensors computed ahead of the writing (eprt.hf.export.PRODUCE_AHEAD_BYTES), the chunk buffers the
quantizing threads keep, and the largest weight being quantized, one tensor at a time: a dense
Linear's whole weight, or a batch of routed-expert rows (eprt.hf.export_quantized.BATCH_ELEMENTS, at
least one row a CPU worker). Nothing else stays: each tensor is read, quantized, written and
dropped. What a weight element costs while it is quantized is its format's own figure
(`WeightFormat.export_working_bytes`); under `mse` the search adds its own
(`export_mse_working_bytes` an element, `mse_search_bytes` a thread). The check of the written output (eprt.hf.check_files) reads
the scales a tensor at a time by byte range, without mapping the shards: a scale grid and its masks,
less than the export held quantizing the weight it scales, so it adds nothing to the peak. The
compressed-tensors layout (INT4, MXFP4) costs nothing of its own: its config is built from eprt's
table of the library's schemes (eprt.hf.compressed_tensors_schemes), without importing the library."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

from eprt.hf.export import PRODUCE_AHEAD_BYTES
from eprt.hf.export_quantized import BATCH_ELEMENTS
from eprt.layout import EXPERT_LEAVES
from eprt.quant.formats import WeightFormat, weight_format
from eprt.quant.recipe import Recipe
from eprt.storage.checkpoint import Checkpoint, TensorMeta
from eprt.units import format_bytes


@dataclass(frozen=True)
class ExportPlan:
    process: int  # bytes the process holds before the export
    ahead: int  # output tensors computed ahead of the writing
    buffers: int  # the chunk buffers the quantizing threads keep
    largest: int  # the largest weight (or batch of expert rows) as read and quantized
    largest_name: str

    @property
    def peak(self) -> int:
        return self.process + self.ahead + self.buffers + self.largest

    def summary(self) -> str:
        parts = [
            f"process {format_bytes(self.process)}",
            f"{self.largest_name} read and quantized {format_bytes(self.largest)}",
            f"output computed ahead {format_bytes(self.ahead)}",
            *([f"chunk buffers {format_bytes(self.buffers)}"] if self.buffers else []),
        ]
        return f"peaks at {format_bytes(self.peak)} ({', '.join(parts)})"


def plan_export(ck: Checkpoint, modules: Iterable[str], recipe: Recipe, workers: int, process: int) -> ExportPlan:
    """The plan of exporting `modules` (dense Linears and routed-experts modules) of `ck` quantized
    under `recipe`, on `workers` CPU workers, in a process that holds `process` bytes."""
    held = [(0, "no weight")]
    formats: set[WeightFormat] = set()
    searches: dict[WeightFormat, int] = {}  # a thread's mse search at its widest, per format
    for m in modules:
        fmt = weight_format(recipe.format_of(m))
        formats.add(fmt)
        mse = recipe.algorithm_of(m) == "mse"
        for name in (f"{m}.weight", *(f"{m}.{leaf}" for leaf in EXPERT_LEAVES)):
            if mse and name in ck.tensors:
                searches[fmt] = max(searches.get(fmt, 0), fmt.mse_search_bytes(ck.tensors[name].shape[-1]))
        if f"{m}.weight" in ck.tensors:
            meta = ck.tensors[f"{m}.weight"]
            held.append((working(meta, fmt, math.prod(meta.shape), mse), f"{m}.weight"))
        for name in (f"{m}.{leaf}" for leaf in EXPERT_LEAVES):
            if name in ck.tensors:
                meta = ck.tensors[name]
                row = math.prod(meta.shape[1:])
                rows = min(meta.shape[0], max(workers, BATCH_ELEMENTS // max(1, row)))
                held.append((working(meta, fmt, rows * row, mse), f"{rows} expert rows of {name}"))
    largest, name = max(held)
    # a thread's buffers, by slot: each format keeps slots of its own, so a thread that quantizes
    # several formats keeps each one's (the MX formats share their block amax's: counted twice, an
    # upper bound). The pool's workers quantize, and the producing thread a piece too small to
    # share out.
    threads = workers + (workers > 1)
    buffers = threads * (sum(f.export_worker_bytes for f in formats) + sum(searches.values()))
    return ExportPlan(process, PRODUCE_AHEAD_BYTES, buffers, largest, name)


def working(meta: TensorMeta, fmt: WeightFormat, elements: int, mse: bool = False) -> int:
    """Bytes of `elements` of weight `meta` as read and quantized in `fmt` (`mse`: its scales searched)."""
    per_element = fmt.export_working_bytes + (fmt.export_mse_working_bytes if mse else 0)
    return math.ceil(elements * (meta.dtype.itemsize + per_element))
