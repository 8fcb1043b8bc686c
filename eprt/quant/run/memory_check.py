"""Refusing a run whose memory plan (eprt.quant.run.memory_plan) does not fit, naming what would fit:
a larger --ep, a smaller --calib-size or --seq-len. Each takes only the sizes, not the data: called
before the calibration data is read, a run too large for its memory builds nothing of that size."""

from __future__ import annotations

from dataclasses import replace

from eprt.errors import ConfigError
from eprt.quant.run.memory_plan import MemoryPlan, RunShape
from eprt.quant.run.planner import Planner, largest_fitting
from eprt.units import format_bytes


def check_memory(planner: Planner, plan: MemoryPlan, limit: int, shape: RunShape, num_experts: int) -> None:
    """Refuse a plan whose peak exceeds `limit`, naming the smallest ep and the largest
    --calib-size that fit, or, where not one sequence fits, the largest --seq-len.

    It needs only the sizes, not the data: call it before the calibration data is read, so that a
    run too large for its memory is refused before it builds anything of that size."""
    if plan.peak <= limit:
        return

    def fits(**change) -> bool:
        return planner.plan(replace(shape, **change), plan.baseline, limit=limit).peak <= limit

    ways = []
    ep = fitting_ep(shape, num_experts, lambda e: fits(ep=e))
    if ep:
        ways.append(f"--ep {ep}")
    size = largest_fitting(shape.num_sequences - 1, lambda n: fits(num_sequences=n))
    if size:
        ways.append(f"--calib-size {size}")
    else:  # not even one sequence of this length fits: the length is what is too large
        length = largest_fitting(shape.seq_len - 1, lambda T: fits(seq_len=T))
        if length:
            ways.append(f"--seq-len {length}")
    way = " or ".join(ways) if ways else "more memory per rank (more ranks, a larger --ep)"
    raise ConfigError(
        f"rank {shape.rank} would peak at {format_bytes(plan.peak)} (weights of the largest layer "
        f"{format_bytes(plan.layer)}, hidden states {format_bytes(plan.hidden)}, step buffers "
        f"{format_bytes(plan.step)}, token ids {format_bytes(plan.tokens)}, process "
        f"{format_bytes(plan.baseline)}), over --max-memory {format_bytes(limit)}: use {way}"
    )


def check_host_memory(
    planner: Planner, plan: MemoryPlan, limit: int, shape: RunShape, num_experts: int, ranks_on_host: int
) -> None:
    """Refuse a GPU rank whose host plan, times the ranks that share its host, exceeds `limit`
    (the host's, for all of them), naming the smallest ep that fits. Like `check_memory`, before
    the data is read."""
    if plan.host is None or plan.host.peak * ranks_on_host <= limit:
        return
    host = plan.host

    def fits(ep: int) -> bool:
        return planner.plan(replace(shape, ep=ep), plan.baseline, host.baseline).host.peak * ranks_on_host <= limit

    ep = fitting_ep(shape, num_experts, fits)
    way = (f"--ep {ep}, or " if ep else "") + "fewer ranks on each host, or a host with more memory free"
    raise ConfigError(
        f"rank {shape.rank} would hold {format_bytes(host.peak)} of host memory ({host.terms()}); "
        f"with the {ranks_on_host} ranks on its host, {format_bytes(host.peak * ranks_on_host)}, over "
        f"--max-host-memory {format_bytes(limit)}: use {way}"
    )


def fitting_ep(shape: RunShape, num_experts: int, fits) -> int | None:
    """The smallest ep above the shape's, of the world and the experts, with fits(ep); None for none."""
    from eprt.parallel.state import valid_ep

    return next((e for e in valid_ep(shape.world, num_experts or None) if e > shape.ep and fits(e)), None)
