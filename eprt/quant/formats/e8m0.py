"""E8M0, the block scale of the MX formats (MXFP8, MXFP4): a power of two stored as its biased
exponent in one byte, 2^(byte - 127), for each block of 32 consecutive elements along the input dim.

MXFP8's block exponent is the least that brings its amax within the element format's largest value:
ceil(log2(amax / largest)), clamped to [-127, 127], and -127 (byte 0) for a zero block, as
ModelOpt's MXFP8 and MXFP4 quantizers compute it (`MXFP8QTensor._compute_e8m0_exponent`), so no
element of a block saturates; MXFP4's is the OCP rule (`ocp_exponents`), which lets a block's top
values saturate for a finer grid. Under `mse` a block takes the exponent that saturates nothing or
the one below, whichever decodes it closer (`Microscaled.mse_candidates`). Byte 255 is E8M0's NaN
and is never written.
"""

from __future__ import annotations

import math

import torch

from eprt.quant.formats.base import ScaledByBlocks
from eprt.quant.numerics import check_finite, chunk_buffer, for_chunks, row_chunks

BLOCK = 32  # elements sharing one E8M0 scale
BIAS = 127
NAN = 255  # E8M0's one code that is not a power of two
FP32_MANTISSA_BITS = 23


def as_blocks(x: torch.Tensor) -> torch.Tensor:
    """x [..., in] as [..., in/32, 32] (the caller has refused an input dim that is not a multiple of 32)."""
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)


def block_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., in/32]: the largest magnitude of each block of x [..., in] (NaN where it holds one),
    a chunk of rows at a time through an fp32 buffer kept from call to call."""
    rows = x.reshape(-1, x.shape[-1])
    n, width = rows.shape
    amax = torch.empty(n, width // BLOCK, device=x.device)
    step, chunks = row_chunks(n, width, x.device)

    def chunk(a: int, b: int, f32: torch.Tensor) -> None:
        torch.amax(as_blocks(f32[: b - a].copy_(rows[a:b]).abs_()), dim=-1, out=amax[a:b])

    for_chunks(chunks, lambda: chunk_buffer("e8m0.amax", (step, width), torch.float32, x.device), chunk, x.device)
    return amax.reshape(*x.shape[:-1], width // BLOCK)


def e8m0_scales(x: torch.Tensor, largest: float) -> torch.Tensor:
    """uint8 biased exponents [..., in/32] of x [..., in] for elements whose largest value is `largest`."""
    return exponents(block_amax(x), largest)


def checked_amax(w: torch.Tensor) -> torch.Tensor:
    """`block_amax` of a weight w. Raises ValueError for a weight holding NaN or infinity."""
    amax = block_amax(w)
    if amax.numel():  # a NaN or infinity shows in its block's amax, and amax keeps NaN
        check_finite(amax.amax(), w.shape)
    return amax


def checked_scales(w: torch.Tensor, largest: float) -> torch.Tensor:
    """`e8m0_scales` of a weight w. Raises ValueError for a weight holding NaN or infinity."""
    return exponents(checked_amax(w), largest)


def exponents(amax: torch.Tensor, largest: float) -> torch.Tensor:
    """uint8 biased exponents of blocks' fp32 `amax` for elements whose largest value is `largest`."""
    descale = amax / largest
    log2 = torch.where(descale > 0, torch.log2(descale), torch.tensor(-float(BIAS), device=amax.device))
    return (torch.ceil(log2).clamp(-BIAS, BIAS) + BIAS).to(torch.uint8)


def ocp_exponents(amax: torch.Tensor, largest: float, mantissa_bits: int) -> torch.Tensor:
    """uint8 biased exponents of blocks' fp32 `amax` by the OCP MX rule as compressed-tensors computes
    it (`generate_mx_scales`): floor(log2(amax)), amax first rounded half up to the element format's
    precision (`mantissa_bits`: E2M1's 1, so a significand from 1.75 up counts as 2), less the exponent
    of its largest value (E2M1's 6: 2); clamped to [-127, 127], byte 0 for a zero block. A block's
    values from `largest` to within half a step above it saturate to `largest` (E2M1: 6 to 7 times the
    scale), for a grid up to twice as fine as `exponents`' (which saturates nothing) would give it."""
    emax = math.frexp(largest)[1] - 1
    half_step = 1 << (FP32_MANTISSA_BITS - mantissa_bits - 1)  # in the fp32 significand's last bits
    rounded = (amax.float().view(torch.int32) + half_step) >> FP32_MANTISSA_BITS  # the exponent field
    biased = torch.where(amax > 0, rounded - emax, torch.zeros_like(rounded))
    return biased.clamp(0, 2 * BIAS).to(torch.uint8)


def e8m0_values(scales: torch.Tensor) -> torch.Tensor:
    """fp32 2^(byte - 127) of uint8 E8M0 scales (exact: 2^-127 is an fp32 subnormal)."""
    return torch.exp2(scales.float() - BIAS)


def scaled_down(x: torch.Tensor, scales: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """fp32 x [..., in] times 2^(127 - byte) of its block's scale [..., in/32]: exact but where it
    leaves the fp32 range, as ModelOpt multiplies (`MXFP8QTensor.quantize_with_scale`); with
    `in_place`, into x (a copy of the caller's own)."""
    blocks, factors = as_blocks(x), torch.exp2(BIAS - scales.float()).unsqueeze(-1)
    return (blocks.mul_(factors) if in_place else blocks * factors).reshape(x.shape)


def scaled_weight(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of weight w [..., in] scaled down by its E8M0 scales (`scaled_down`), made in
    one pass, for the caller to round in place."""
    return scaled_down(w.to(torch.float32, copy=True), scales, in_place=True)


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
    scale_width = BLOCK
    mse_grid_bytes = 3  # the two candidate exponents and the chosen one, a byte each

    def mse_candidates(self, w: torch.Tensor) -> list[torch.Tensor]:
        # max's exponent and the one below, which clips the block's top values to a grid twice as
        # fine (byte 0 has none below: it stays). One above is never closer: within the block's
        # amax its grid is max's with the finest steps doubled; two below clips more than the
        # finer steps can give back.
        scales = self.scales_of(w)
        return [scales, scales.clamp(min=1).sub_(1)]

    def row_scales(self, scales: torch.Tensor, out_dim: int) -> torch.Tensor:
        # a power of two: dividing by it is exact where multiplying by its inverse is, as the
        # export's encoder scales a block down (`scaled_down`)
        return e8m0_values(scales)
