"""E8M0, the block scale of the MX formats (MXFP8, MXFP4): a power of two stored as its biased
exponent in one byte, 2^(byte - 127), for each block of 32 consecutive elements along the input dim.

A block's exponent is the least that brings its amax within the element format's largest value:
ceil(log2(amax / largest)), clamped to [-127, 127], and -127 (byte 0) for a zero block, as
ModelOpt's MXFP8 and MXFP4 quantizers compute it (`MXFP8QTensor._compute_e8m0_exponent`), so no
element of a block saturates. Byte 255 is E8M0's NaN and is never written.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from eprt.quant.formats.base import ScaledByBlocks

BLOCK = 32  # elements sharing one E8M0 scale
BIAS = 127
NAN = 255  # E8M0's one code that is not a power of two


def as_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] as [..., in/32, 32] (the caller has refused an input dim that is not a multiple of 32)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def e8m0_scales(x: torch.Tensor, largest: float) -> torch.Tensor:
    """uint8 biased exponents [..., in/32] of x [..., in] for elements whose largest value is `largest`."""
    descale = as_blocks(x).float().abs().amax(dim=-1) / largest
    log2 = torch.where(descale > 0, torch.log2(descale), torch.tensor(-float(BIAS), device=x.device))
    return (torch.ceil(log2).clamp(-BIAS, BIAS) + BIAS).to(torch.uint8)


def e8m0_values(scales: torch.Tensor) -> torch.Tensor:
    """fp32 2^(byte - 127) of uint8 E8M0 scales (exact: 2^-127 is an fp32 subnormal)."""
    return torch.exp2(scales.float() - BIAS)


def scaled_down(x: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 x [..., in] times 2^(127 - byte) of its block's scale [..., in/32]: exact but where it
    leaves the fp32 range, as ModelOpt multiplies (`MXFP8QTensor.quantize_with_scale`)."""
    return (as_blocks(x) * torch.exp2(BIAS - scales.float()).unsqueeze(-1)).reshape(x.shape)


def scaled_up(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 element values [..., in] times their block's scale 2^(byte - 127) [..., in/32]."""
    return (as_blocks(values.float()) * e8m0_values(scales).unsqueeze(-1)).reshape(values.shape)


def check_shape(scales: torch.Tensor, stored: torch.Tensor, in_dim: int, what: str) -> None:
    """Refuses E8M0 scales whose shape is not the grid [..., in/32] of a weight of input dim `in_dim`."""
    want = (*stored.shape[:-1], in_dim // BLOCK)
    if scales.dtype != torch.uint8 or tuple(scales.shape) != want:
        raise ValueError(
            f"E8M0 scales {scales.dtype} {list(scales.shape)} do not fit {what} weight {list(stored.shape)}: "
            f"expected uint8 {list(want)}"
        )


class Microscaled(ScaledByBlocks):
    """What the OCP microscaling formats (MXFP8, MXFP4) share beyond that: blocks of 32 along the
    input dim, each under its own E8M0 scale."""

    group_size = BLOCK
    ct_strategy = "group"
