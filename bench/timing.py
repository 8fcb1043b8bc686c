"""Timing shared by the benchmarks."""

import time

import torch


def timed(fn, device: torch.device, iters: int) -> float:
    """Best seconds per call over `iters` calls after a warm-up call: on a shared machine the
    fastest call is the steadiest estimate of what the code itself costs."""
    fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)
