"""Symmetric INT4 weights in groups along the input dim, inputs left in bf16 (W4A16): the format the
Kimi releases ship their routed experts in (Kimi-K2-Thinking, K2.5: compressed-tensors
`pack-quantized`, groups of 32), which vLLM and SGLang run with Marlin kernels on Ampere and
Hopper (docs/export.md, 'INT4').

Two grids (`GRIDS`, a rule's `grid:`; a rule naming none takes its source's, eprt.quant.source_grid):
the Kimi releases' (`kimi`, `int4` and `int4_g32`): codes -7..7 under a bf16 scale per group of about
amax / 7 (the releases store bf16 scales; a zero group gets 1.0), so a code of -8 is never written;
and compressed-tensors' own symmetric one (`full`, `int4_full` and `int4_g32_full`), llm-compressor's:
codes -8..7 under about amax / 7.5, where a group's largest magnitude lands on 7.5, rounded to 8 and
kept at -8 or clamped to 7. A code is the
quotient weight / scale rounded half to even and clamped, compressed-tensors' own rounding; the
quotient is taken in the weight's dtype (bf16 / bf16, as the library's quantizer divides), or in fp32
for any other dtype. A value is code x scale, exact in fp32 (4 by 8 significant bits). A group's
scale is amax / 7 (7.5) rounded to bf16, or the bf16 neighbour of that under which the group decodes
closer (`_Groups.closest_neighbour`): a decoded INT4 weight (a Kimi release, converted) so re-quantizes to
its own codes and scales in every group that reaches the code 7 or -7.

Codes are stored as compressed-tensors packs them: eight a little-endian int32, element i of each
eight in bits 4i..4i+3 as code + 8 (`weight_packed` [out, in/8]), with `weight_scale` [out, in/group]
and `weight_shape` [out, in]. No calibrated statistic enters: the scales come from the weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from eprt.quant.formats.base import Tensors, WeightFormat
from eprt.quant.formats.block_columns import column_block
from eprt.quant.formats.e2m1 import pack_fp4, unpack_fp4
from eprt.quant.numerics import CHUNK_ELEMENTS, FP32_TINY, check_finite, chunk_buffer, for_chunks, row_chunks


class Grid(NamedTuple):
    name: str
    lowest: int  # the most negative code (the largest is 7)
    divisor: float  # a group's scale is about its amax / divisor


KIMI = Grid("kimi", -7, 7.0)  # the Kimi releases' symmetric grid
FULL = Grid("full", -8, 7.5)  # compressed-tensors' symmetric grid (llm-compressor's)
GRIDS = {g.name: g for g in (KIMI, FULL)}
GRID_MAX = 7  # the largest code of either grid
OFFSET = 8  # a code is stored as code + 8, a nibble 1..15
CODES_PER_WORD = 8  # 4-bit codes in one int32
SCALE_DTYPE = torch.bfloat16  # the Kimi releases' weight_scale, as the engines read it
# Scale factors (of max's amax / 7) the mse search tries per group, max's first: a tie keeps max's.
MSE_FACTORS = tuple(1.0 - 0.025 * i for i in range(21))  # 1.0 down to 0.5


def _as_groups(x: torch.Tensor, group: int) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group, group)


class _Groups:
    """A weight [..., in] as fp32 groups [..., in/group, group] (exact but for float64), held in
    buffers `kept` (fp32 weight, fp32 work, bf16 rounding; each of w's shape at least: a chunk's,
    eprt.quant.numerics.chunk_buffer) or fresh ones. The quotient is taken as in w's dtype where it
    is bf16 (torch's bf16 division rounds its fp32 quotient once: here through the bf16 buffer, so
    that every step works in the kept buffers), in fp32 for any other.
    `shape`: the whole weight's, which a refusal names."""

    def __init__(self, w: torch.Tensor, group: int, grid: Grid, kept: tuple | None = None, shape=None):
        self.grid = grid
        n = w.numel()
        fresh = (torch.empty(n, device=w.device) for _ in range(2))
        f, work, rounded = kept or (*fresh, torch.empty(n, dtype=SCALE_DTYPE, device=w.device))
        self.f32 = _as_groups(f.view(-1)[:n].view(w.shape).copy_(w), group)
        self._work = _as_groups(work.view(-1)[:n].view(w.shape), group)
        self._rounded = _as_groups(rounded.view(-1)[:n].view(w.shape), group)
        self._bf16_quotient = w.dtype == torch.bfloat16
        self._shape = self.f32.shape if shape is None else (*shape[:-1], shape[-1] // group, group)

    def amax(self) -> torch.Tensor:
        """fp32 [..., in/group]; raises ValueError for NaN or infinity."""
        amax = torch.abs(self.f32, out=self._work).amax(dim=-1)
        if amax.numel():
            check_finite(amax.amax(), self._shape)
        return amax

    def _to_bf16(self, x: torch.Tensor) -> torch.Tensor:
        """x (fp32, the work buffer) rounded to bf16 in place, as torch's bf16 arithmetic rounds."""
        return x.copy_(self._rounded.copy_(x))

    def codes(self, scales: torch.Tensor) -> torch.Tensor:
        """The codes under bf16 `scales` [..., in/group], as fp32 in the work buffer (valid until the
        next call): the quotient rounded half to even, clamped to the grid."""
        q = torch.div(self.f32, scales.float().unsqueeze(-1), out=self._work)
        if self._bf16_quotient:
            self._to_bf16(q)
        return q.round_().clamp_(self.grid.lowest, GRID_MAX)

    def error(self, scales: torch.Tensor) -> torch.Tensor:
        """fp32 [..., in/group]: each group's squared error, its values decoded in bf16 as the engines
        and compressed-tensors decode (code x scale, exact in fp32, rounded to bf16)."""
        values = self._to_bf16(self.codes(scales).mul_(scales.float().unsqueeze(-1)))
        return values.sub_(self.f32).square_().sum(-1)

    def closest_neighbour(self, nearest: torch.Tensor) -> torch.Tensor:
        """Per group, of bf16 scales `nearest` and its two bf16 neighbours, the one whose codes decode
        closest to the weight (`error`), `nearest` on a tie. A decoded INT4 weight so re-quantizes to
        its own scales: amax / 7 of a group decoded in bf16 misses its scale by an ulp in about one
        group in nine (7 x scale rounded to bf16, divided by 7, rounded again), where its own scale
        decodes it exactly."""
        best, best_err = nearest, self.error(nearest)
        for step in (-1, 1):
            candidate = (nearest.view(torch.int16) + step).view(SCALE_DTYPE).clamp_(min=FP32_TINY)
            err = self.error(candidate)
            better = err < best_err
            best, best_err = torch.where(better, candidate, best), torch.where(better, err, best_err)
        return best


def nearest_scales(amax: torch.Tensor, grid: Grid) -> torch.Tensor:
    """bf16 amax / the grid's divisor (computed in fp32), at least the smallest normal; a zero amax's 1.0."""
    nearest = (amax / grid.divisor).to(SCALE_DTYPE).clamp_(min=FP32_TINY)
    return torch.where(amax == 0, torch.ones_like(nearest), nearest)


def int4_scales(w: torch.Tensor, group: int, grid: Grid = KIMI) -> torch.Tensor:
    """bf16 scales [..., in/group] of w [..., in]: each group's amax / the grid's divisor rounded to
    bf16 (a zero group's 1.0), or the bf16 neighbour of that which decodes the group closer. Raises
    ValueError for NaN or infinity."""
    return int4_quantized(w, group, grid=grid)[0]


def int4_quantized(
    w: torch.Tensor, group: int, scales: torch.Tensor | None = None, grid: Grid = KIMI
) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16 group scales [..., in/group], packed codes int32 [..., in/8]) of w [..., in]: the scales
    given, or `int4_scales`' rule; the codes `pack_int4(int4_codes(w, scales))`. A chunk of rows
    at a time through each thread's kept buffers (eprt.quant.numerics.chunk_buffer): the weight is
    read once, and no full-size temporary is made."""
    rows = w.reshape(-1, w.shape[-1])
    n, width = rows.shape
    out = torch.empty(n, width // group, dtype=SCALE_DTYPE, device=w.device) if scales is None else scales
    out = out.reshape(n, width // group)
    packed = torch.empty(n, width // 2, dtype=torch.uint8, device=w.device)
    step, chunks = row_chunks(n, width, w.device)

    def buffers() -> tuple[torch.Tensor, ...]:
        slots = (("weight", torch.float32), ("work", torch.float32), ("rounded", SCALE_DTYPE))
        return tuple(chunk_buffer(f"int4.{slot}", (step, width), dtype, w.device) for slot, dtype in slots)

    def chunk(a: int, b: int, kept: tuple[torch.Tensor, ...]) -> None:
        groups = _Groups(rows[a:b], group, grid, tuple(t[: b - a] for t in kept), w.shape)
        if scales is None:
            out[a:b] = groups.closest_neighbour(nearest_scales(groups.amax(), grid))
        codes = groups.codes(out[a:b]).add_(OFFSET).view(b - a, width)
        # a byte of each pair, the first code in the low nibble, into the spent weight buffer
        pairs = kept[0].view(-1)[: (b - a) * width // 2].view(b - a, width // 2)
        packed[a:b] = torch.add(codes[:, 0::2], codes[:, 1::2], alpha=1 << 4, out=pairs)

    for_chunks(chunks, buffers, chunk, w.device)
    # the sizes spelled out: a weight of no rows has no -1 to infer
    return out.reshape(*w.shape[:-1], width // group), packed.view(torch.int32).reshape(
        *w.shape[:-1], width // CODES_PER_WORD
    )


def int4_codes(w: torch.Tensor, scales: torch.Tensor, grid: Grid = KIMI) -> torch.Tensor:
    """int8 codes [..., in] on `grid` of w [..., in] under its group scales [..., in/group]: the
    quotient as in w's dtype where it is bf16 (else fp32), rounded half to even, clamped."""
    return _Groups(w, w.shape[-1] // scales.shape[-1], grid).codes(scales).to(torch.int8).reshape(w.shape)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int32 [..., in/8] of int8 codes [..., in], as compressed-tensors' `pack_to_int32` packs them
    (eight a word, the first in the lowest bits: two a byte, little-endian)."""
    return pack_fp4((codes + OFFSET).to(torch.uint8)).view(torch.int32)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """int8 codes [..., 8n] of int32 packed [..., n]; inverse of `pack_int4`."""
    return unpack_fp4(packed.contiguous().view(torch.uint8)).to(torch.int8) - OFFSET


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """w [..., in] from (packed int32 [..., in/8], scales [..., in/group]): code x scale in fp32 (exact),
    returned as `dtype`."""
    codes = unpack_int4(packed)
    if scales.dim() != codes.dim() or scales.shape[:-1] != codes.shape[:-1] or codes.shape[-1] % scales.shape[-1]:
        raise ValueError(
            f"INT4 group scales {list(scales.shape)} do not fit packed weight {list(packed.shape)} "
            f"({codes.shape[-1]} inputs a row)"
        )
    return _values(codes, scales, dtype)


def _values(codes: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """code x its group's scale, in fp32 (exact), returned as `dtype`."""
    group = codes.shape[-1] // scales.shape[-1]
    values = _as_groups(codes.float(), group) * scales.float().unsqueeze(-1)
    return values.reshape(codes.shape).to(dtype)


def int4_mse_scales(w: torch.Tensor, group: int, grid: Grid = KIMI) -> torch.Tensor:
    """bf16 group scales of least squared error for w [..., in]: each group's own choice among max's
    scale (`int4_scales`) and amax x MSE_FACTORS[1:] / the grid's divisor rounded to bf16, in that
    order, so a tie keeps max's."""
    groups = _Groups(w, group, grid)
    amax = groups.amax()
    best = groups.closest_neighbour(nearest_scales(amax, grid))
    best_err = groups.error(best)
    for factor in MSE_FACTORS[1:]:
        scales = nearest_scales(amax * factor, grid)
        err = groups.error(scales)
        better = err < best_err
        best, best_err = torch.where(better, scales, best), torch.where(better, err, best_err)
    return best


class Int4Columns:
    """GPTQ's columns in INT4, for a stack of original weights w [L, out, in]: the group scales fixed
    from w (the export's), column j rounded under its group's scale by the export's rule."""

    def __init__(self, w: torch.Tensor, group: int, grid: Grid):
        self.group, self.grid = group, grid
        self.scales = int4_scales(w, group, grid)
        self.step = self.scales.float()

    def round(self, j: int | torch.Tensor, col_LO: torch.Tensor) -> torch.Tensor:
        step = column_block(self.step, j, self.group)
        return (col_LO.float() / step).round_().clamp_(self.grid.lowest, GRID_MAX) * step

    def encode(self, q: torch.Tensor) -> torch.Tensor:
        """Packed codes (int32 [L, out, in/8]) of GPTQ's weights: each an exact multiple of its scale."""
        return pack_int4(int4_codes(q.float(), self.scales, self.grid))

    def decode(self, packed: torch.Tensor) -> torch.Tensor:
        return dequantize_int4(packed, self.scales)


class Int4(WeightFormat):
    """INT4 codes in groups of `group_size` along the input dim with bf16 group scales; bf16 inputs.
    Every group has its own scale, so nothing is shared by fused Linears."""

    quant_algo = "W4A16"  # compressed-tensors' scheme name; ModelOpt has no plain INT4 layout eprt writes
    num_bits = 4
    block_scale_leaf = "weight_scale"
    rounds_in_weight_dtype = True  # as compressed-tensors' quantizer divides a bf16 weight
    uses_activation_statistics = False
    modelopt_layout = False
    weight_scale_leaf = None
    ct_preset, ct_format = "W4A16", "pack-quantized"
    ct_strategy = "group"
    ct_weight_type = "int"
    ct_weight_scale_leaf = ct_input_scale_leaf = None
    largest_input = None

    def __init__(self, name: str, group_size: int, grid: Grid = KIMI):
        self.name, self.group_size, self.grid = name, group_size, grid

    @property
    def kind(self) -> tuple:
        return (type(self), self.grid)  # in other groups, on the same grid

    # each thread's chunk buffers: the fp32 weight and work, the bf16 rounding (`int4_quantized`)
    export_worker_bytes = (4 + 4 + 2) * CHUNK_ELEMENTS

    @property
    def export_working_bytes(self) -> float:
        # the packed codes (1/2); a group's amax, candidate scales, errors and choices (32 bytes)
        return 1 / 2 + 32 / self.group_size

    @property
    def export_mse_working_bytes(self) -> float:
        # the search's groups over the whole weight (`int4_mse_scales`): its fp32 copy, fp32 work and
        # bf16 rounding (10 bytes), and a group's amax, candidates, errors and choices (32 bytes)
        return 4 + 4 + 2 + 32 / self.group_size

    def scale(self, amax) -> torch.Tensor:
        # no per-tensor scale is written; the export asks for one of every format, and gets amax's
        return torch.as_tensor(amax, dtype=torch.float32).reshape(())

    def quantize(self, w: torch.Tensor, w_scale: torch.Tensor, mse: bool) -> dict[str, torch.Tensor]:
        searched = int4_mse_scales(w, self.group_size, self.grid) if mse else None
        scales, packed = int4_quantized(w, self.group_size, searched, self.grid)
        return {"weight": packed, "weight_scale": scales}

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_int4(t["weight"], t["weight_scale"], dtype)

    def fake_quantize_input(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x  # the engine computes with the inputs as they come

    def columns(self, w: torch.Tensor, scales: torch.Tensor) -> Int4Columns:
        return Int4Columns(w, self.group_size, self.grid)

    def modelopt_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        # what `quantize` returns; no ModelOpt layout is written (`modelopt_layout`)
        return {
            "weight": (torch.int32, (out_dim, in_dim // CODES_PER_WORD)),
            "weight_scale": (SCALE_DTYPE, (out_dim, in_dim // self.group_size)),
        }

    def compressed_tensors_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {
            "weight_packed": (torch.int32, (out_dim, in_dim // CODES_PER_WORD)),
            "weight_scale": (SCALE_DTYPE, (out_dim, in_dim // self.group_size)),
            "weight_shape": (torch.int32, (2,)),
        }

    def to_compressed_tensors(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        packed = t["weight"]
        shape = torch.tensor([packed.shape[0], packed.shape[1] * CODES_PER_WORD], dtype=torch.int32)
        return {"weight_packed": packed, "weight_scale": t["weight_scale"], "weight_shape": shape}

    def in_dim_of_stored(self, stored_in_dim: int) -> int:
        return CODES_PER_WORD * stored_in_dim

    def modelopt_input_group(self) -> dict | None:
        return None

    def largest_code(self, largest_block: float | None) -> float:
        return -self.grid.lowest


INT4 = Int4("int4", 128)
INT4_G32 = Int4("int4_g32", 32)  # the Kimi releases' groups
INT4_FULL = Int4("int4_full", 128, FULL)
INT4_G32_FULL = Int4("int4_g32_full", 32, FULL)
