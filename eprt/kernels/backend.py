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


@functools.cache
def _cpu_multiplies(dtype: torch.dtype) -> bool:
    """Whether this CPU has dot-product instructions for `dtype` (AVX512-BF16 or AMX for bf16,
    AMX-FP16 for fp16). Without them the BLAS emulates the low-precision GEMM, 4-8x slower than
    its fp32 GEMM on the same operands (`python bench/cpu_matmul.py`)."""
    probes = {
        torch.bfloat16: ("_is_avx512_bf16_supported", "_is_amx_tile_supported"),
        torch.float16: ("_is_amx_fp16_supported",),
    }[dtype]
    return any(getattr(torch.cpu, probe, lambda: False)() for probe in probes)


def matmul_dtype(dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype a matmul of `dtype` operands computes in: fp32 for bf16 and fp16 on a CPU that
    cannot multiply them natively, else `dtype` itself. Widening is exact (a bf16 or fp16 product
    fits fp32's mantissa) and the result is rounded once back to `dtype`, which is what the
    low-precision GEMM computes too: it accumulates in fp32. Only the order of the sum may
    differ, and it is the same for every layout: the choice depends on the machine alone."""
    if device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and not _cpu_multiplies(dtype):
        return torch.float32
    return dtype


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
