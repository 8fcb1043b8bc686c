"""DeepSeek-V4's FP4 routed experts as its release stores them (`deepseek-fp4`): `M.weight` int8
[rows, cols / 2], two E2M1 codes a byte (the first of each pair in the low nibble, as torch's
float4_e2m1fn_x2), and `M.scale` float8_e8m0fnu [rows, cols / 32], one power of two 2^(e - 127) per
32 of a row: w = e2m1 x scale, every value exact in bf16. (Its FP8 weights, whose `M.scale` is an
E8M0 per 128x128 block, are block FP8: eprt.storage.encodings.DeepSeekFP8.) A decoder of its own
(`.components`, `.decode`), which eprt.storage.encodings reaches by its encoding's name.
"""

from __future__ import annotations

import torch

from eprt.errors import CheckpointError

FP4_BLOCK = 32
# E2M1's sixteen codes (sign bit 3): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
DECODED = torch.bfloat16


def e8m0_exponents(scale: torch.Tensor) -> torch.Tensor:
    """The E8M0 scales as their uint8 exponents (stored float8_e8m0fnu, or uint8 already)."""
    return scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale


class DeepSeekFP4:
    components = ("weight", "scale")
    batched = True  # weights stacked along leading dims decode each with its own scales
    on_device = True  # plain tensor arithmetic: decodes on the device its components are on

    def decode(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_fp4(c["weight"], c["scale"])


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n] bytes -> [..., 2n] fp32 values, each byte's low nibble first."""
    b = packed.view(torch.uint8).long()
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    return torch.tensor(E2M1_VALUES, device=packed.device)[codes]


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = DECODED) -> torch.Tensor:
    """The weight [..., rows, 2 x packed cols] of FP4 codes and their E8M0 scale per 32 along a row."""
    values = unpack_e2m1(packed)
    e = e8m0_exponents(scale)
    want = (*values.shape[:-1], values.shape[-1] // FP4_BLOCK)
    if values.shape[-1] % FP4_BLOCK or tuple(e.shape) != want:
        raise CheckpointError(
            f"an FP4 weight of {list(values.shape)} values has scales of shape {list(e.shape)}, not one "
            f"per {FP4_BLOCK} values of a row {list(want)}"
        )
    factor = torch.exp2(e.float() - 127.0).masked_fill(e == 255, float("nan"))
    return (values.unflatten(-1, (-1, FP4_BLOCK)) * factor.unsqueeze(-1)).flatten(-2).to(dtype)
