"""The one place that picks a kernel implementation: Triton on CUDA, torch everywhere else."""

import functools
import os

import torch


@functools.cache
def triton_available() -> bool:
    """Triton is optional: eprt imports and runs on CPU without it."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda and triton_available()


def triton_interpreting() -> bool:
    """True when Triton runs kernels on the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def check_values(ok: torch.Tensor, message: str) -> None:
    """Refuse bad tensor contents: ValueError on CPU, an asynchronous device assert on CUDA.

    On CUDA a host check would stall the stream on every call; the device assert still stops
    the run (it poisons the CUDA context) instead of letting a kernel read out of bounds.
    """
    if ok.is_cuda:
        torch._assert_async(ok, message)
    elif not bool(ok):
        raise ValueError(message)
