"""FP8 E4M3 weights with one static fp32 scale per output channel (row), with inputs the engine
quantizes at run time per token: the FP8 Hopper and Ampere engines run from both layouts,
TensorRT-LLM's compressed-tensors loader included (docs/export.md, 'FP8 per channel').

A row's scale is its own amax / 448 (a zero row: 1.0; under `mse`, amax x c / 448 for the c of
least error, as FP8 block searches a block's: eprt.quant.formats.fp8_block.MSE_FACTORS), and a
quantized value fp32(w) / its row's scale rounded once to E4M3 nearest-even: the quotient of a
bf16 weight by a scale tensor is fp32 by torch's type promotion, as ModelOpt's
FP8_PER_CHANNEL_PER_TOKEN export divides it. ModelOpt stores the scales as [out],
compressed-tensors as [out, 1]. No calibrated statistic enters.
"""

from __future__ import annotations

import torch

from eprt.quant.formats.base import ScaledByBlocks, Tensors
from eprt.quant.formats.block_columns import e4m3_values
from eprt.quant.formats.fp8_block import fake_quant_input_groups, fp8_mse_candidates, fp8_scales
from eprt.quant.numerics import FP8_E4M3_MAX, to_e4m3


def row_amax(w: torch.Tensor) -> torch.Tensor:
    """fp32 [..., out]: the largest magnitude of each row of w [..., out, in]."""
    return w.to(torch.float32, copy=True).abs_().amax(dim=-1)


def fp8_channel_scales(w: torch.Tensor) -> torch.Tensor:
    """fp32 scales [..., out] of w [..., out, in]: each row's amax / 448, a zero row's 1.0."""
    return fp8_scales(row_amax(w), w.shape)


def quantize_fp8_channel(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of w [..., out, in] under its row scales [..., out]."""
    quotient = w.to(torch.float32, copy=True).div_(scales.unsqueeze(-1))  # one fp32 copy, divided in place
    return to_e4m3(quotient, out=torch.empty_like(quotient, dtype=torch.float8_e4m3fn))


def dequantize_fp8_channel(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes times their row's scale, in fp32, returned as `dtype`."""
    if tuple(scales.shape) != tuple(q.shape[:-1]):
        raise ValueError(
            f"row scales {list(scales.shape)} do not fit FP8 weight {list(q.shape)}: expected {list(q.shape[:-1])}"
        )
    return (q.float() * scales.float().unsqueeze(-1)).to(dtype)


class Fp8Channel(ScaledByBlocks):
    """FP8 E4M3 weights with an fp32 scale per output channel; inputs quantized by the engine per
    token. Every row has its own scale, so nothing is shared by fused Linears."""

    name = "fp8_channel"
    quant_algo = "FP8_PER_CHANNEL_PER_TOKEN"
    num_bits = 8
    ct_preset, ct_format = "FP8_DYNAMIC", "float-quantized"
    ct_strategy = "channel"
    export_working_bytes = 4 + 1  # the fp32 quotient, divided in place (4), and the codes (1)

    scales_of = staticmethod(fp8_channel_scales)
    encode = staticmethod(quantize_fp8_channel)
    decode = staticmethod(dequantize_fp8_channel)
    scale_width = None  # a row's one scale
    round_quotient = staticmethod(e4m3_values)

    def mse_candidates(self, w: torch.Tensor) -> list[torch.Tensor]:
        return fp8_mse_candidates(row_amax(w), w.shape)

    def row_scales(self, scales: torch.Tensor, out_dim: int) -> torch.Tensor:
        return scales.float().unsqueeze(-1)

    def fake_quantize_input(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quant_input_groups(x, max(1, x.shape[-1]))  # one group: the whole token

    def unfit_input_dim(self, in_dim: int) -> bool:
        return False

    def modelopt_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {"weight": (torch.float8_e4m3fn, (out_dim, in_dim)), "weight_scale": (torch.float32, (out_dim,))}

    def compressed_tensors_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {"weight": (torch.float8_e4m3fn, (out_dim, in_dim)), "weight_scale": (torch.float32, (out_dim, 1))}

    def to_compressed_tensors(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"weight": t["weight"], "weight_scale": t["weight_scale"].unsqueeze(-1)}

    def modelopt_group(self) -> dict:
        return {"dynamic": False, "num_bits": 8, "type": "float", "strategy": "channel"}

    def modelopt_input_group(self) -> dict | None:
        return {"dynamic": True, "num_bits": 8, "type": "float", "strategy": "token"}

    def largest_code(self, largest_block: float | None) -> float:
        return FP8_E4M3_MAX


FP8_CHANNEL = Fp8Channel()
