"""INT4 weights with FP8 inputs the engine quantizes at run time per token (W4A8): INT4's codes and
bf16 group scales in groups of 128, byte for byte (eprt.quant.formats.int4), as compressed-tensors'
W4AFP8 scheme declares them; the fastest MoE path on Hopper (vLLM's and SGLang's CUTLASS W4A8
kernels; docs/export.md, 'W4A8'), on either of INT4's grids (`w4a8`, `w4a8_full`). Each token's
scale is its own amax / 448, so nothing is calibrated.
"""

from __future__ import annotations

import torch

from eprt.quant.formats.fp8_block import fake_quant_input_groups
from eprt.quant.formats.int4 import FULL, Int4


class W4a8(Int4):
    """INT4 weights in groups of 128 (bf16 group scales); FP8 E4M3 inputs, one scale per token."""

    quant_algo = "W4AFP8"
    ct_preset = "W4AFP8"

    def fake_quantize_input(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quant_input_groups(x, max(1, x.shape[-1]))  # one group: the whole token

    def modelopt_input_group(self) -> dict | None:
        return {"dynamic": True, "num_bits": 8, "type": "float", "strategy": "token"}


W4A8 = W4a8("w4a8", 128)
W4A8_FULL = W4a8("w4a8_full", 128, FULL)  # compressed-tensors' own grid (a rule's `grid: full`)
