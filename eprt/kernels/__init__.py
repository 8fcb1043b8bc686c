"""Kernel entry points. Each has a Triton implementation for CUDA and a torch fallback for CPU."""

from eprt.kernels.grouped_gemm import grouped_mm, unit_act, unit_mlp
from eprt.kernels.permute import combine, permute

__all__ = ["grouped_mm", "unit_mlp", "unit_act", "permute", "combine"]
