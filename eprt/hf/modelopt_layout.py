"""The ModelOpt layout of one quantized Linear (docs/export.md): the tensors it stores in place of
its weight, with their dtypes and shapes. The export writes them; the checker expects them."""

from __future__ import annotations

import torch

from eprt.quant.nvfp4 import BLOCK_SIZE


def companions(fmt: str, out_dim: int, in_dim: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors of one `fmt` (fp8, nvfp4) Linear of weight [out_dim, in_dim]: suffix -> (dtype, shape)."""
    if fmt == "fp8":
        return {"weight": (torch.float8_e4m3fn, (out_dim, in_dim)), "weight_scale": (torch.float32, ()),
                "input_scale": (torch.float32, ())}
    return {"weight": (torch.uint8, (out_dim, in_dim // 2)),
            "weight_scale": (torch.float8_e4m3fn, (out_dim, in_dim // BLOCK_SIZE)),
            "weight_scale_2": (torch.float32, ()), "input_scale": (torch.float32, ())}
