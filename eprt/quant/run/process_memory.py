"""What this process holds, as the memory plan's baseline and its measured peak: the resident set on
CPU, torch's allocations on CUDA, and what the device or the host has free."""

from __future__ import annotations

import os

import torch


def current_rss() -> int:
    """Bytes this process holds now (resident set), 0 where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss() -> int:
    """The largest resident set this process has had, in bytes: /proc's VmHWM, which starts
    afresh at exec (getrusage's ru_maxrss keeps the high-water mark of the process that forked
    this one: a large parent makes a small child look large)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_in_use(device: torch.device) -> int:
    """What the plan's baseline is: the process's resident set on CPU, torch's allocations on CUDA."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else current_rss()


def measured_peak(device: torch.device) -> int:
    """What the plan predicts: the peak resident set on CPU, torch's peak allocation on CUDA."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss()


def available_memory(device: torch.device) -> int:
    """The default --max-memory: the device's free memory on CUDA, the host's available RAM on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")
