"""NVFP4 weights with inputs left unquantized (W4A16): NVFP4's codes, block scales and per-tensor
weight_scale_2, byte for byte (eprt.quant.formats.nvfp4), without an input scale, for engines that
run FP4 weights against bf16 activations (vLLM's and TensorRT-LLM's weight-only FP4 kernels on
Hopper and Ampere; docs/export.md, 'NVFP4 weights only'). Fused Linears share weight_scale_2 as under
NVFP4: the engines keep one for a fused weight.
"""

from __future__ import annotations

import torch

from eprt.quant.formats.base import Tensors
from eprt.quant.formats.nvfp4 import Nvfp4


class Nvfp4A16(Nvfp4):
    """NVFP4 weights (16-element E2M1 blocks, E4M3 block scales, weight_scale_2); bf16 inputs."""

    name = "nvfp4_a16"
    quant_algo = "W4A16_NVFP4"
    ct_preset = "NVFP4A16"
    ct_input_scale_leaf = None
    largest_input = None
    uses_activation_statistics = False
    input_block = None

    def fake_quantize_input(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x  # the engine computes with the inputs as they come

    def modelopt_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {k: v for k, v in super().modelopt_tensors(out_dim, in_dim).items() if k != "input_scale"}

    def compressed_tensors_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {
            k: v for k, v in super().compressed_tensors_tensors(out_dim, in_dim).items() if k != "input_global_scale"
        }

    def modelopt_input_group(self) -> dict | None:
        return None


NVFP4_A16 = Nvfp4A16()
