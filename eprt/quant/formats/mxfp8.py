"""MXFP8: FP8 E4M3 weights with an E8M0 (power-of-two) scale per 32 elements along the input dim,
and inputs the engine quantizes at run time the same way, each token's groups of 32 under their
own E8M0 scale: the OCP microscaling format Blackwell's tensor cores run natively (vLLM's and
TensorRT-LLM's MXFP8 kernels; docs/export.md, 'MXFP8').

A block's scale is 2^ceil(log2(amax / 448)) (eprt.quant.formats.e8m0), and a code fp32(w) times
2^-exponent (exact) rounded once to E4M3 nearest-even, as ModelOpt 0.47's MXFP8 export computes
them; a zero block's scale byte is 0. Both layouts store the same bytes: float8_e4m3fn `weight`
[out, in] and uint8 `weight_scale` [out, in/32]. No calibrated statistic enters.
"""

from __future__ import annotations

import torch

from eprt.quant.formats.base import Tensors
from eprt.quant.formats.block_columns import e4m3_values
from eprt.quant.formats.e8m0 import (
    BLOCK,
    Microscaled,
    check_shape,
    checked_scales,
    e8m0_scales,
    scaled_up,
    scaled_weight,
)
from eprt.quant.numerics import CHUNK_ELEMENTS, FP8_E4M3_MAX, to_e4m3


def mxfp8_scales(w: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 scales [..., in/32] of w [..., in]. Raises ValueError for a weight holding NaN or infinity."""
    return checked_scales(w, FP8_E4M3_MAX)


def quantize_mxfp8(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of w [..., in] under its E8M0 scales."""
    quotient = scaled_weight(w, scales)
    return to_e4m3(quotient, out=torch.empty_like(quotient, dtype=torch.float8_e4m3fn))


def dequantize_mxfp8(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes times their block's scale, in fp32, returned as `dtype`."""
    check_shape(scales, q, q.shape[-1], "MXFP8")
    return scaled_up(q.float(), scales).to(dtype)


def fake_quant_mx_input(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] as an MXFP8 engine quantizes it at run time, in x's dtype: each token's blocks of
    32 under their own E8M0 scale."""
    scales = e8m0_scales(x, FP8_E4M3_MAX)
    return dequantize_mxfp8(quantize_mxfp8(x, scales), scales, x.dtype)


class Mxfp8(Microscaled):
    """E4M3 weights in blocks of 32 with E8M0 scales; inputs quantized by the engine in blocks of 32."""

    name = "mxfp8"
    quant_algo = "MXFP8"
    num_bits = 8
    ct_preset, ct_format = "MXFP8", "mxfp8-quantized"
    # the fp32 quotient, scaled in place (4), the codes (1) and a scale byte a block of 32; each
    # thread keeps the block amax's fp32 chunk buffer (e8m0.block_amax)
    export_working_bytes = 4 + 1 + 1 / BLOCK
    export_worker_bytes = 4 * CHUNK_ELEMENTS

    scales_of = staticmethod(mxfp8_scales)
    encode = staticmethod(quantize_mxfp8)
    decode = staticmethod(dequantize_mxfp8)
    round_quotient = staticmethod(e4m3_values)

    def fake_quantize_input(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quant_mx_input(x)

    def modelopt_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {
            "weight": (torch.float8_e4m3fn, (out_dim, in_dim)),
            "weight_scale": (torch.uint8, (out_dim, in_dim // BLOCK)),
        }

    def compressed_tensors_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return self.modelopt_tensors(out_dim, in_dim)

    def to_compressed_tensors(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"weight": t["weight"], "weight_scale": t["weight_scale"]}

    def largest_code(self, largest_block: float | None) -> float:
        return FP8_E4M3_MAX


MXFP8 = Mxfp8()
