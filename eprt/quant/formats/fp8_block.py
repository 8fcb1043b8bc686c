"""FP8 E4M3 weights in 128x128 blocks, one fp32 scale a block, with inputs the engine quantizes
at run time per token in groups of 128: the block FP8 DeepSeek-V3, Qwen3 and Kimi-K2 ship, which
Hopper and Ampere engines run (docs/export.md, 'FP8 block').

A block's scale is its own amax / 448 (a zero block: 1.0, ModelOpt's export rule for a zero amax);
under `mse`, amax x c / 448 for the c of least error (`MSE_FACTORS`, eprt.quant.formats.block_mse).
A weight dimension that is not a multiple of 128 ends in a partial block whose scale comes from its
own values, as the releases store them (`weight_scale_inv` [ceil(out/128), ceil(in/128)]). A
quantized value is fp32(w) / its block's scale, rounded once to E4M3 nearest-even: the quotient
of a bf16 weight by a scale tensor is fp32 by torch's type promotion, as ModelOpt's FP8_PB_WO
export divides it. No calibrated statistic enters: the weight scales come from the weights and
the inputs are scaled by the engine, token by token.
"""

from __future__ import annotations

import math

import torch

from eprt.quant.formats.base import ScaledByBlocks, Tensors
from eprt.quant.formats.block_columns import e4m3_values
from eprt.quant.numerics import FP8_E4M3_MAX, FP32_TINY, check_finite, to_e4m3

BLOCK = 128  # a weight block is BLOCK x BLOCK, an input group BLOCK consecutive elements of a token


def grid_shape(out_dim: int, in_dim: int) -> tuple[int, int]:
    """The block-scale grid of a weight [out_dim, in_dim]: partial edge blocks count."""
    return math.ceil(out_dim / BLOCK), math.ceil(in_dim / BLOCK)


def as_blocks(w: torch.Tensor) -> torch.Tensor:
    """An fp32 copy of w [..., out, in] of its own (the caller writes into it) as blocks
    [..., rows, 128, cols, 128]; a partial edge block is padded with zeros, which leave its amax
    its own values' and are dropped from its codes. One pass over w, where spreading each block's
    scale to every element took three."""
    *lead, out_dim, in_dim = w.shape
    rows, cols = grid_shape(out_dim, in_dim)
    if (rows * BLOCK, cols * BLOCK) == (out_dim, in_dim):
        f = w.to(torch.float32, copy=True)
    else:
        f = torch.zeros((*lead, rows * BLOCK, cols * BLOCK), dtype=torch.float32, device=w.device)
        f[..., :out_dim, :in_dim] = w
    return f.reshape(*lead, rows, BLOCK, cols, BLOCK)


def of_blocks(blocks: torch.Tensor, shape) -> torch.Tensor:
    """Blocks [..., rows, 128, cols, 128] (`as_blocks`) back as the tensor of `shape` [..., out, in]
    they pad, contiguous."""
    *lead, rows, _, cols, _ = blocks.shape
    whole = blocks.reshape(*lead, rows * BLOCK, cols * BLOCK)
    return whole if tuple(whole.shape) == tuple(shape) else whole[..., : shape[-2], : shape[-1]].contiguous()


def block_amax(w: torch.Tensor) -> torch.Tensor:
    """fp32 [..., ceil(out/128), ceil(in/128)] abs-max of each block of w [..., out, in]."""
    *lead, out_dim, in_dim = w.shape
    rows, cols = grid_shape(out_dim, in_dim)
    if (rows * BLOCK, cols * BLOCK) != (out_dim, in_dim):  # partial blocks: a zero-padded fp32 copy
        return as_blocks(w).abs_().amax(dim=-1).amax(dim=-2)
    # In w's own dtype (a maximum of magnitudes is exact in any), over each block's 128 rows first:
    # a reduction across rows runs along whole contiguous rows, three times as fast as one along
    # each row's 128 elements of a block, and no fp32 copy of w is made.
    per_column = w.abs().reshape(*lead, rows, BLOCK, cols * BLOCK).amax(dim=-2)
    return per_column.reshape(*lead, rows, cols, BLOCK).amax(dim=-1).float()


def fp8_block_scales(w: torch.Tensor) -> torch.Tensor:
    """fp32 block scales [..., ceil(out/128), ceil(in/128)] of w [..., out, in]: amax / 448, a zero
    block's 1.0. Raises ValueError for a weight holding NaN or infinity."""
    return fp8_scales(block_amax(w), w.shape)


# The factors of a block's (row's) amax whose scales, amax x c / 448, the mse search tries
# (eprt.quant.formats.block_mse): max's 1 first, then 1 + k/16 to 1.9375, every placement of the
# values against E4M3's binades at 1/16 apart. Above 2 a grid is the grid at c/2 made coarser at the
# bottom (the same binades, the finest step doubled), never closer; below 1 it is the grid at 2c
# clipped at the top, closer only for values beneath E4M3's normals, by less than the clipping costs.
MSE_FACTORS = tuple(1 + k / 16 for k in range(16))


def fp8_mse_candidates(amax: torch.Tensor, shape) -> list[torch.Tensor]:
    """The scales of fp32 amaxes (each block's, each row's) of a weight of `shape` the mse search
    tries: `fp8_scales(amax * c)` for c in MSE_FACTORS, max's first."""
    return [fp8_scales(amax * c, shape) for c in MSE_FACTORS]


def fp8_scales(amax: torch.Tensor, shape) -> torch.Tensor:
    """The fp32 scales of fp32 amaxes of a weight of `shape` (each block's, each row's): amax / 448,
    as ModelOpt's export computes them: a zero amax counts as 448, any other as at least the
    smallest normal fp32. Raises ValueError for an amax of NaN or infinity (the weight held one)."""
    if amax.numel():
        check_finite(amax.amax(), shape)
    return torch.where(amax == 0, FP8_E4M3_MAX, amax).clamp_(min=FP32_TINY).div_(FP8_E4M3_MAX)


def per_block(scales: torch.Tensor) -> torch.Tensor:
    """Block scales [..., rows, cols] as they broadcast over blocks [..., rows, 128, cols, 128]."""
    return scales[..., :, None, :, None]


# Columns of a band of 128 rows quantized at once where the blocks tile the weight: 16 blocks, 1 MiB of
# fp32, which stays in a core's cache through the piece's four passes (to fp32, divide, clamp, round),
# where the whole weight's fp32 copy went to memory and back in each: twice the speed on 2048 x 7168
# weights (`python bench/model_free.py --child arithmetic 2048 7168`), the same on a weight of one piece.
PIECE_COLUMNS = 16 * BLOCK


def quantize_fp8_block(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn codes of w [..., out, in] under its block scales (`fp8_block_scales`)."""
    *lead, out_dim, in_dim = w.shape
    if out_dim % BLOCK or in_dim % BLOCK:  # partial edge blocks: the zero-padded blocks of the whole weight
        quotient = as_blocks(w).div_(per_block(scales))
        return of_blocks(to_e4m3(quotient, out=torch.empty_like(quotient, dtype=torch.float8_e4m3fn)), w.shape)
    codes = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    rows_w, rows_codes = w.reshape(-1, in_dim), codes.view(-1, in_dim)  # stacked weights' bands one after another
    band_scales = scales.reshape(-1, in_dim // BLOCK)
    width = min(in_dim, PIECE_COLUMNS)
    piece = torch.empty((BLOCK, width), dtype=torch.float32, device=w.device)
    for band in range(band_scales.shape[0]):
        rows = slice(band * BLOCK, (band + 1) * BLOCK)
        for start in range(0, in_dim, width):
            part = rows_w[rows, start : start + width]
            f = piece[:, : part.shape[1]].copy_(part)  # a bf16 weight's fp32 quotient, as the blocks' division gives it
            blocks = band_scales[band, start // BLOCK : (start + part.shape[1]) // BLOCK]
            f.view(BLOCK, -1, BLOCK).div_(blocks[:, None])
            to_e4m3(f, out=rows_codes[rows, start : start + width])
    return codes


def dequantize_fp8_block(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes times their block's scale, in fp32, returned as `dtype`."""
    want = (*q.shape[:-2], *grid_shape(*q.shape[-2:]))
    if tuple(scales.shape) != want:
        raise ValueError(
            f"block scales {list(scales.shape)} do not fit FP8 weight {list(q.shape)}: expected {list(want)}"
        )
    return of_blocks(as_blocks(q).mul_(per_block(scales.float())), q.shape).to(dtype)


def fake_quant_input_groups(x: torch.Tensor, group: int = BLOCK) -> torch.Tensor:
    """x [..., in] as an FP8 engine quantizes it at run time, in x's dtype: each token's groups of
    `group` (the last one partial; a group of `in` is the whole token) under their own scale,
    amax / 448 (DeepSeek-V3's `act_quant`)."""
    width = x.shape[-1]
    groups = math.ceil(width / group)
    padded = torch.nn.functional.pad(x.float(), (0, groups * group - width)).reshape(*x.shape[:-1], groups, group)
    amax = padded.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax == 0, FP8_E4M3_MAX, amax).div_(FP8_E4M3_MAX)
    out = to_e4m3(padded / scale).float().mul_(scale)
    return out.reshape(*x.shape[:-1], groups * group)[..., :width].to(x.dtype)


class Fp8Block(ScaledByBlocks):
    """FP8 E4M3 weights in 128x128 blocks with fp32 block scales; inputs quantized by the engine,
    per token in groups of 128. Nothing per tensor, so nothing for fused Linears to share."""

    name = "fp8_block"
    # GPTQ in the columns' order: the descending-diagonal order raised the KL on three of four trained
    # models' slices (1.11-1.17x, docs/quality.md "GPTQ's column order") while every 4-bit grid gained
    gptq_actorder = False
    quant_algo = "FP8_PB_WO"  # ModelOpt's FP8 per-block, its weights only: the inputs are the engine's
    num_bits = 8
    blocks_span_rows = True
    ct_preset, ct_format = "FP8_BLOCK", "float-quantized"
    ct_strategy = "block"
    # the fp32 copy of the blocks divided in place (4), the codes (1), and their contiguous copy
    # where a dim ends in a partial block (1)
    export_working_bytes = 4 + 1 + 1

    scales_of = staticmethod(fp8_block_scales)
    encode = staticmethod(quantize_fp8_block)
    decode = staticmethod(dequantize_fp8_block)
    scale_width = scale_height = BLOCK
    round_quotient = staticmethod(e4m3_values)

    def mse_candidates(self, w: torch.Tensor) -> list[torch.Tensor]:
        return fp8_mse_candidates(block_amax(w), w.shape)

    def row_scales(self, scales: torch.Tensor, out_dim: int) -> torch.Tensor:
        # each grid row stands for 128 weight rows, the last one for what is left of them
        return scales.float().repeat_interleave(BLOCK, dim=-2)[..., :out_dim, :]

    def fake_quantize_input(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quant_input_groups(x)

    def unfit_input_dim(self, in_dim: int) -> bool:
        return False  # a partial last block

    def modelopt_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {
            "weight": (torch.float8_e4m3fn, (out_dim, in_dim)),
            "weight_scale": (torch.float32, grid_shape(out_dim, in_dim)),
        }

    def compressed_tensors_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return self.modelopt_tensors(out_dim, in_dim)

    def to_compressed_tensors(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"weight": t["weight"], "weight_scale": t["weight_scale"]}

    def modelopt_group(self) -> dict:
        return {
            "dynamic": False,
            "num_bits": 8,
            "type": "float",
            "strategy": "block",
            "block_structure": [BLOCK, BLOCK],
        }

    def modelopt_input_group(self) -> dict | None:
        return {"dynamic": True, "num_bits": 8, "type": "float", "strategy": "group", "group_size": BLOCK}

    def largest_code(self, largest_block: float | None) -> float:
        return FP8_E4M3_MAX


FP8_BLOCK = Fp8Block()
