"""NVFP4 quantization, byte-exact to the ModelOpt Hugging Face export (docs/export.md, 'Numerics').

Two-level scaling over blocks of 16 consecutive elements along the last (input) dim:
  weight_scale_2 = w_amax / (6*448)                                   fp32 0-dim
  block_scale    = e4m3(clamp(block_amax / (6*weight_scale_2), 2^-9, 448)), 1.0 for a zero block
  code           = E2M1(w / (float(block_scale) * weight_scale_2)), ties to even, saturating at 6
(E2M1 codes and their packing: eprt.quant.formats.e2m1). input_scale = in_amax / (6*448) has the
weight_scale_2 formula, and activations are quantized by the same block rule at run time. Under
`mse` each block's scale is searched (`nvfp4_mse_block_scale`); weight_scale_2 stays max's.

Zero amax gives scale 1/448, and scales have a floor: see `eprt.quant.numerics`.
"""

import torch
import torch.nn.functional as F

from eprt.quant.formats.base import CT_SCALAR, Tensors, WeightFormat
from eprt.quant.formats.block_columns import column_block
from eprt.quant.formats.e2m1 import (
    E2M1_MAX,
    PAIR_CODES,
    PAIR_OFFSET,
    PAIR_VALUES,
    QUARTER_VALUES,
    Q,
    e2m1_decode,
    e2m1_encode,
    encode_quarters,
    pack_fp4,
    quarter_keys,
)
from eprt.quant.formats.e8m0 import BIAS as E8M0_BIAS
from eprt.quant.formats.e8m0 import BLOCK as E8M0_BLOCK
from eprt.quant.formats.e8m0 import e8m0_scales, scaled_down
from eprt.quant.numerics import (
    CHUNK_ELEMENTS,
    FP8_E4M3_MAX,
    as_scale,
    check_finite,
    chunk_buffer,
    e4m3_values,
    for_chunks,
    per_tensor_scale,
    row_chunks,
    to_e4m3,
)

BLOCK_SIZE = 16
# Smallest block scale: the smallest E4M3 subnormal, so no block scale is ever zero.
MIN_BLOCK_SCALE = 2.0**-9
# Weight dtypes divided by an fp32 block scale as they are: torch widens them to fp32 exactly.
WIDENED = (torch.float32, torch.bfloat16, torch.float16)


def nvfp4_scale(amax) -> torch.Tensor:
    """NVFP4 per-tensor scale (weight_scale_2, input_scale): fp32 0-dim amax/(6*448).

    `amax` is a Python number or a one-element tensor; amax == 0 gives 1/448.
    """
    return per_tensor_scale(amax, E2M1_MAX * FP8_E4M3_MAX, zero_amax=E2M1_MAX)


# ModelOpt's "four over six" normalisation of weight_scale_2 (its E4M3_MAX_46): a block at the tensor's
# amax then takes block scale 256 to map its amax to 6, and up to 448 (1.75x) to map it to 4
HEADROOM_E4M3_MAX = 256.0


def nvfp4_headroom_scale(amax) -> torch.Tensor:
    """weight_scale_2 with headroom: fp32 0-dim amax/(6*256) (amax == 0 gives 1/256)."""
    return per_tensor_scale(amax, E2M1_MAX * HEADROOM_E4M3_MAX, zero_amax=E2M1_MAX)


def _check_blocks(x: torch.Tensor) -> None:
    """Refuses an input dim that is not a multiple of 16."""
    if x.dim() == 0 or x.shape[-1] % BLOCK_SIZE != 0:
        raise ValueError(
            f"NVFP4 quantizes blocks of {BLOCK_SIZE} consecutive elements along the last (input) dim: "
            f"shape {tuple(x.shape)} has an input dim that is not a multiple of {BLOCK_SIZE}; "
            "exclude this module from NVFP4 quantization"
        )


def _as_blocks(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // BLOCK_SIZE, BLOCK_SIZE)


def _block_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 [..., in/16]: the largest magnitude of each block of x [..., in] (NaN where a block
    holds one: max pooling keeps NaN), a chunk of rows at a time through an fp32 buffer."""
    blocks = x.shape[-1] // BLOCK_SIZE  # spelled out: a tensor of no rows (a rank given none) has no -1 to infer
    rows = x.reshape(-1, x.shape[-1])
    amax = torch.empty(rows.shape[0], blocks, device=x.device)
    step, chunks = row_chunks(*rows.shape, x.device)

    def block_amax(a: int, b: int, f32: torch.Tensor) -> None:
        f = f32[: b - a].copy_(rows[a:b]).abs_()
        amax[a:b] = F.max_pool1d(f.unsqueeze(0), BLOCK_SIZE)[0]  # a block's max in one vectorized pass

    for_chunks(
        chunks, lambda: chunk_buffer("nvfp4.amax", (step, rows.shape[1]), torch.float32, x.device), block_amax, x.device
    )
    return amax.reshape(*x.shape[:-1], blocks)


def _block_scales(block_amax: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    scale = (block_amax / (E2M1_MAX * scale_2)).clamp(MIN_BLOCK_SCALE, FP8_E4M3_MAX)
    # Chosen in fp32 (1.0 is exact in E4M3): not every device has float8 kernels for `where`.
    return to_e4m3(torch.where(block_amax == 0, 1.0, scale))


def _rows_of(w: torch.Tensor) -> torch.Tensor:
    """w [..., in] as rows [n, in] the quotient divides as they are: float8 (torch divides it by
    nothing) and float64 as their fp32 values."""
    return (w if w.dtype in WIDENED else w.float()).reshape(-1, w.shape[-1])


def _for_key_chunks(rows: torch.Tensor, denom: torch.Tensor, slots: tuple, body) -> None:
    """body(a, b, key, f, bufs) for every chunk [a, b) of rows [n, in] (eprt.quant.numerics.row_chunks):
    `key` the chunk's quarter keys (`quarter_keys`) under its blocks' denominators `denom`
    [n, in/16, 1] (block scale * scale_2), of the quotient in fp32 (ModelOpt's: widened exactly,
    then divided) times 4 (exact: a power of two), held in `f`, which body may overwrite;
    `bufs` this thread's kept buffers of `slots` ((name, divisor of in, dtype)) for the chunk."""
    n, width = rows.shape
    step, chunks = row_chunks(n, width, rows.device)
    slots = (("quotient", 1, torch.float32), ("keys", 1, torch.float32), *slots)

    def buffers() -> tuple[torch.Tensor, ...]:
        return tuple(
            chunk_buffer(f"nvfp4.{slot}", (step, width // part), dtype, rows.device) for slot, part, dtype in slots
        )

    def chunk(a: int, b: int, kept: tuple[torch.Tensor, ...]) -> None:
        f, keys, *bufs = (t[: b - a] for t in kept)
        # widened into f first, then divided in place: a division of bf16 by fp32 would widen
        # into a fresh temporary of its own each chunk
        _as_blocks(f.copy_(rows[a:b])).div_(denom[a:b])
        body(a, b, quarter_keys(f.mul_(4), keys), f, bufs)

    for_chunks(chunks, buffers, chunk, rows.device)


def _encode_packed(w: torch.Tensor, block_scale: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes uint8 [..., in/2] of w [..., in] under its block scales [..., in/16],
    encoded and packed a chunk of rows at a time."""
    rows = _rows_of(w)
    n, width = rows.shape
    if not n:
        return torch.empty(*w.shape[:-1], width // 2, dtype=torch.uint8, device=w.device)
    denom = e4m3_values(block_scale).mul_(scale_2).reshape(n, -1, 1)
    packed = torch.empty(n, width // 2, dtype=torch.uint8, device=w.device)
    table = PAIR_CODES.to(w.device)

    def encode(a: int, b: int, key: torch.Tensor, _f, bufs: list[torch.Tensor]) -> None:
        pair_keys, pair_index = bufs
        key = key.view(b - a, -1, 2)
        pair = torch.add(key[..., 0], key[..., 1], alpha=4 * Q, out=pair_keys).add_(PAIR_OFFSET)
        torch.index_select(table, 0, pair_index.copy_(pair).view(-1), out=packed[a:b].view(-1))

    _for_key_chunks(rows, denom, (("pair_keys", 2, torch.float32), ("pair_index", 2, torch.int32)), encode)
    return packed.reshape(*w.shape[:-1], width // 2)


def quantize_nvfp4(
    w: torch.Tensor, scale_2, block_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight uint8 [..., in/2], weight_scale float8_e4m3fn [..., in/16]) for w [..., in].

    `scale_2` is the fp32 per-tensor weight_scale_2 (from `nvfp4_scale`; shared by fused
    projections, so it may come from a larger amax than w's own). Any leading dims are kept, so
    stacked experts [E, out, in] quantize in one call. Computed in fp32 whatever w's dtype.
    `block_scale` (float8_e4m3fn [..., in/16], positive): block scales chosen elsewhere (the
    `mse` search, `nvfp4_mse_block_scale`) instead of the block-amax rule above.
    """
    scale_2, block_scale = _scales_of(w, scale_2, block_scale)
    return _encode_packed(w, block_scale, scale_2), block_scale


def _scales_of(w: torch.Tensor, scale_2, block_scale: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale_2 as an fp32 0-dim tensor, the block scales: given, checked, or by the block-amax rule)."""
    block_amax = _checked_block_amax(w)
    scale_2 = as_scale(scale_2, w.device)
    if block_scale is None:
        return scale_2, _block_scales(block_amax, scale_2)
    if block_scale.dtype != torch.float8_e4m3fn or block_scale.shape != block_amax.shape:
        raise ValueError(
            f"block scales {block_scale.dtype} {tuple(block_scale.shape)} do not fit weight "
            f"{tuple(w.shape)}: expected float8_e4m3fn {tuple(block_amax.shape)}"
        )
    return scale_2, block_scale


def _checked_block_amax(w: torch.Tensor) -> torch.Tensor:
    _check_blocks(w)
    block_amax = _block_amax(w)
    if block_amax.numel():  # a NaN or infinity shows in its block's amax, and amax keeps NaN
        check_finite(block_amax.amax(), w.shape)
    return block_amax


def nvfp4_block_scales(w: torch.Tensor, scale_2) -> torch.Tensor:
    """float8_e4m3fn block scales [..., in/16] of w [..., in] under `scale_2` (the export's rule)."""
    return _block_scales(_checked_block_amax(w), as_scale(scale_2, w.device))


def encode_with_scales(w: torch.Tensor, block_scale: torch.Tensor, scale_2) -> torch.Tensor:
    """uint8 E2M1 codes [..., in] of w [..., in] under given block scales [..., in/16] (unpacked):
    the export's rounding, also for block scales fixed from another weight (GPTQ's columns)."""
    scale_2 = as_scale(scale_2, w.device)
    quarters = (_as_blocks(w.float()) / (block_scale.float() * scale_2).unsqueeze(-1)).mul_(4)  # exact: a power of two
    return encode_quarters(quarters).reshape(w.shape)


def dequantize_nvfp4(
    packed: torch.Tensor, block_scale: torch.Tensor, scale_2, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """w [..., in] from (packed uint8 [..., in/2], block_scale e4m3 [..., in/16], scale_2).

    Value times block scale is exact in fp32 (3 by 4 significant bits), so the one rounding is
    the multiplication by scale_2.
    """
    width = 2 * packed.shape[-1]
    # the block count spelled out: a tensor of no rows (a rank given none) has no -1 to infer
    blocks_shape = (*packed.shape[:-1], width // BLOCK_SIZE)
    if blocks_shape != tuple(block_scale.shape):
        raise ValueError(
            f"block scale shape {tuple(block_scale.shape)} does not fit packed weight "
            f"{tuple(packed.shape)}: expected {blocks_shape}"
        )
    index = packed.reshape(-1).to(torch.int32)
    values = PAIR_VALUES.to(packed.device).index_select(0, index).view(*blocks_shape, BLOCK_SIZE)
    values.mul_(e4m3_values(block_scale).unsqueeze(-1)).mul_(as_scale(scale_2, packed.device))
    return values.view(*packed.shape[:-1], width).to(dtype)


def fake_quant_nvfp4(
    x: torch.Tensor, scale_2, block_scale: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Quantize-dequantize over the last dim, in `dtype` (default x's).

    For weights pass weight_scale_2 (and the block scales where they were chosen elsewhere: see
    `quantize_nvfp4`); for activations pass input_scale: the engines compute an activation's
    block scales at run time by the same block rule.

    The bits of `dequantize_nvfp4(*quantize_nvfp4(x, ...), dtype)`, a chunk of rows at a time without
    the codes: each quotient's key looks its value up directly, which is then scaled as
    `dequantize_nvfp4` scales it.
    """
    scale_2, block_scale = _scales_of(x, scale_2, block_scale)
    rows = _rows_of(x)
    n, width = rows.shape
    out = torch.empty(x.shape, dtype=dtype or x.dtype, device=x.device)
    if not n:
        return out
    block = e4m3_values(block_scale).reshape(n, -1, 1)
    out_rows = out.view(n, width)
    table = QUARTER_VALUES.to(x.device)

    def fake(a: int, b: int, key: torch.Tensor, f: torch.Tensor, bufs: list[torch.Tensor]) -> None:
        (index,) = bufs
        torch.index_select(table, 0, index.copy_(key).add_(2 * Q).view(-1), out=f.view(-1))
        out_rows[a:b] = _as_blocks(f).mul_(block[a:b]).mul_(scale_2).view(b - a, width)

    _for_key_chunks(rows, block * scale_2, (("value_index", 1, torch.int32),), fake)
    return out


# --- MXFP4 weights in NVFP4, value for value (docs/export.md, 'MXFP4 weights in NVFP4') ------------
# A weight stored in MXFP4 (Kimi-K3's experts) is E2M1 codes times 2^k per block of 32. NVFP4 holds
# it exactly where each 16-element block's scale times weight_scale_2 is that 2^k: weight_scale_2 =
# 2^(k_max - 8) puts the largest block's scale at E4M3's 2^8, and a block k steps below it gets
# 2^(k - k_max + 8), exact down to E4M3's smallest, 2^-9; the codes are then the source's own. A
# block further below is rounded under 2^-9 as the block-amax rule rounds it (its scale clamps
# there too). ModelOpt 0.47's closed-form cast (`quantize_mxfp4_to_nvfp4_lossless`) does the same.
E4M3_POW2_RANGE = (-9, 8)  # the powers of two E4M3 holds


def mx_exponents(w: torch.Tensor) -> torch.Tensor | None:
    """int32 [..., in/32]: each 32-element block's exponent k (ceil(log2(amax / 6)), the least under
    which it does not saturate; -127 for a zero block) where every block of w [..., in] is exactly
    E2M1 values times 2^k, as a weight stored in MXFP4 decodes; None for any other weight. The first
    row is tried alone first: a weight quantized from bf16 fails there."""
    if w.dim() == 0 or w.shape[-1] % E8M0_BLOCK or not w.numel():
        return None
    rows = w.reshape(-1, w.shape[-1])
    for part in (rows[:1], rows):
        scales = e8m0_scales(part, E2M1_MAX)
        q = scaled_down(part.float(), scales)
        if not torch.equal(e2m1_decode(e2m1_encode(q)), q):
            return None
    return (scales.to(torch.int32) - E8M0_BIAS).reshape(*w.shape[:-1], -1)


def _is_power_of_two(x: torch.Tensor) -> bool:
    return bool(x > 0) and float(torch.frexp(x.float()).mantissa) == 0.5


def mx_exact_scale_2(w: torch.Tensor) -> torch.Tensor | None:
    """weight_scale_2 = 2^(k_max - 8) (fp32 0-dim) of a weight stored in MXFP4 (`mx_exponents`), k_max
    its largest block's exponent, or None for any other weight and an all-zero one. It is a power of
    two, which amax / (6 * 448) of such a weight never is (448 = 1.75 x 2^8): `mx_block_scales` knows
    it by that."""
    k = mx_exponents(w)
    if k is None or not bool((k > -E8M0_BIAS).any()):
        return None
    return torch.tensor(2.0 ** (int(k.max()) - E4M3_POW2_RANGE[1]), dtype=torch.float32)


def mx_block_scales(w: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor | None:
    """float8_e4m3fn block scales [..., in/16] that keep a weight stored in MXFP4 exactly under a
    power-of-two weight_scale_2 (`mx_exact_scale_2`): 2^(k - log2(scale_2)) clamped to E4M3's powers
    of two, 1.0 for a zero block; None for any other weight or scale_2."""
    if not _is_power_of_two(scale_2):
        return None
    k = mx_exponents(w)
    if k is None:
        return None
    m = int(torch.frexp(scale_2.float()).exponent) - 1
    scale = torch.exp2((k - m).clamp(*E4M3_POW2_RANGE).float()).repeat_interleave(E8M0_BLOCK // BLOCK_SIZE, -1)
    zero = _block_amax(w) == 0
    return to_e4m3(torch.where(zero, 1.0, scale))


def mxfp4_blocks_not_kept(scales: torch.Tensor) -> tuple[int, int]:
    """(blocks of 32, those NVFP4 cannot keep exactly) of MXFP4 weights [E, rows, in] from their
    E8M0 scales uint8 [E, rows, in/32] (a stacked experts tensor: one weight_scale_2 per expert): a
    nonzero block more than 17 binades below its expert's largest (byte 0 is a zero block's)."""
    k = scales.to(torch.int32) - E8M0_BIAS
    nonzero = scales > 0
    k_max = torch.where(nonzero, k, -E8M0_BIAS).flatten(1).amax(dim=1).view(-1, *([1] * (k.dim() - 1)))
    below = nonzero & (k - (k_max - E4M3_POW2_RANGE[1]) < E4M3_POW2_RANGE[0])
    return k.numel(), int(below.sum())


# Every positive finite E4M3 value, ascending: the bit patterns 1..126 (127 is NaN).
MSE_BLOCK_SCALES = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn)
# Weight elements per step of the block-scale search, which quantizes them once per candidate in
# one call: bounds its working memory (a few float64 copies of 126 x this), not its result.
MSE_CHUNK_ELEMENTS = 1 << 13


def nvfp4_mse_block_scale(w: torch.Tensor, scale_2) -> torch.Tensor:
    """float8_e4m3fn block scales [..., in/16] of least squared error for w [..., in] under
    weight_scale_2 `scale_2`: each block's own choice among MSE_BLOCK_SCALES (ModelOpt's FP8 scale
    sweep, `NVFP4MSECalibrator`), which includes max's own, so a tie (argmin keeps the first)
    never leaves mse's error above max's. Errors are summed in float64. Rows are independent, so
    they are searched a chunk of rows at a time, every candidate in one quantize call."""
    rows = w.reshape(-1, w.shape[-1])
    blocks = rows.shape[-1] // BLOCK_SIZE
    out = torch.empty(rows.shape[0], blocks, dtype=torch.float8_e4m3fn, device=w.device)
    step = max(1, MSE_CHUNK_ELEMENTS // rows.shape[-1])
    candidates = MSE_BLOCK_SCALES.to(w.device)
    for first in range(0, rows.shape[0], step):
        chunk = rows[first : first + step]
        scale = candidates.view(-1, 1, 1).expand(candidates.numel(), chunk.shape[0], blocks)
        xq = dequantize_nvfp4(
            quantize_nvfp4(chunk.expand(candidates.numel(), *chunk.shape), scale_2, scale)[0], scale, scale_2
        )
        x = chunk.double().reshape(1, chunk.shape[0], blocks, BLOCK_SIZE)
        err = (xq.double().reshape(-1, chunk.shape[0], blocks, BLOCK_SIZE) - x).square_().sum(-1)
        out[first : first + step] = candidates[err.argmin(dim=0)]  # argmin: the first of equal errors
    return out.reshape(*w.shape[:-1], blocks)


def _fixed_block_scales(w: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    """The export's block scales of original weight w under `scale_2`: an MXFP4 source's exact ones, else the block-amax rule's."""
    exact = mx_block_scales(w, scale_2)
    return exact if exact is not None else nvfp4_block_scales(w, scale_2)


class Nvfp4Columns:
    """GPTQ's columns in NVFP4, for a stack of original weights w [L, out, in]: weight_scale_2
    `scales` [L] and the E4M3 block scales fixed from w (the export's: from its blocks' amax, or an
    MXFP4 source's exact ones);
    column j is rounded with its rows' block scale by the export's E2M1 rule (nearest, ties to
    even, saturating at 6)."""

    def __init__(self, w: torch.Tensor, scales: torch.Tensor):
        self.scales = scales.float().to(w.device)
        self.block_scale = torch.stack([_fixed_block_scales(x, s) for x, s in zip(w, self.scales)])
        self.step = self.block_scale.float() * self.scales[:, None, None]  # the export's divisor of each block

    def round(self, j: int | torch.Tensor, col_LO: torch.Tensor) -> torch.Tensor:
        bs = column_block(self.block_scale, j, BLOCK_SIZE).float()
        values = e2m1_decode(e2m1_encode(col_LO.float() / column_block(self.step, j, BLOCK_SIZE)))
        return values * bs * self.scales[:, None]  # as `dequantize_nvfp4`: value x block scale is exact

    def encode(self, q: torch.Tensor) -> torch.Tensor:
        """Packed E2M1 codes (uint8 [L, out, in/2]) of GPTQ's weights, by the export's encoder."""
        return torch.stack([pack_fp4(encode_with_scales(x, b, s)) for x, b, s in zip(q, self.block_scale, self.scales)])

    def decode(self, packed: torch.Tensor) -> torch.Tensor:
        return torch.stack([dequantize_nvfp4(p, b, s) for p, b, s in zip(packed, self.block_scale, self.scales)])


class Nvfp4(WeightFormat):
    """NVFP4: E2M1 codes in 16-element blocks with E4M3 block scales and an fp32 per-tensor scale
    (weight_scale_2); inputs by the same block rule under a static per-tensor input_scale."""

    name = "nvfp4"
    quant_algo = "NVFP4"
    num_bits = 4
    group_size = BLOCK_SIZE
    shares_fused_scales = True
    weight_scale_leaf = "weight_scale_2"
    block_scale_leaf = "weight_scale"
    ct_preset, ct_format = "NVFP4", "nvfp4-pack-quantized"
    ct_strategy = "tensor_group"
    # compressed-tensors dequantizes a block as value * weight_scale / weight_global_scale
    ct_weight_scale_leaf, ct_input_scale_leaf = "weight_global_scale", "input_global_scale"
    ct_reciprocal = True
    largest_input = E2M1_MAX * FP8_E4M3_MAX
    input_block = BLOCK_SIZE
    # the packed codes (1/2), an E4M3 block scale, the fp32 block amax and divisor a block of 16;
    # each thread's chunk buffers: the fp32 amax rows, quotient and keys (4 + 4 + 4), each pair's
    # fp32 key and int32 index (2 + 2 an element)
    export_working_bytes = 1 / 2 + (1 + 4 + 4) / BLOCK_SIZE
    export_worker_bytes = (4 + 4 + 4 + 2 + 2) * CHUNK_ELEMENTS

    def scale(self, amax) -> torch.Tensor:
        return nvfp4_scale(amax)

    def headroom_scale(self, amax) -> torch.Tensor:
        return nvfp4_headroom_scale(amax)

    def exact_weight_scale(self, w: torch.Tensor) -> torch.Tensor | None:
        return mx_exact_scale_2(w)

    def mxfp4_blocks_kept(self, scales: torch.Tensor) -> tuple[int, int] | None:
        blocks, not_kept = mxfp4_blocks_not_kept(scales)
        return blocks, blocks - not_kept

    def block_scale(self, w: torch.Tensor, scale_2: torch.Tensor, mse: bool) -> torch.Tensor | None:
        """A weight stored in MXFP4 under its exact weight_scale_2: the block scales that keep it
        exactly (`mx_block_scales`, under mse too: no error to search away); else the searched block
        scales under mse, else None (`quantize_nvfp4` derives them from the block amax)."""
        exact = mx_block_scales(w, scale_2)
        if exact is not None:
            return exact
        return nvfp4_mse_block_scale(w, scale_2) if mse else None

    def quantize(self, w: torch.Tensor, w_scale: torch.Tensor, mse: bool) -> dict[str, torch.Tensor]:
        q, block_scale = quantize_nvfp4(w, w_scale, self.block_scale(w, w_scale, mse))
        return {"weight": q, "weight_scale": block_scale, "weight_scale_2": w_scale}

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_nvfp4(t["weight"], t["weight_scale"], t["weight_scale_2"], dtype)

    def fake_quantize_weight(
        self, w: torch.Tensor, w_scale: torch.Tensor, mse: bool, dtype: torch.dtype
    ) -> torch.Tensor:
        return fake_quant_nvfp4(w, w_scale, self.block_scale(w, w_scale, mse), dtype)  # in one pass, without the codes

    def fake_quantize_input(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quant_nvfp4(x, scale)

    def columns(self, w: torch.Tensor, scales: torch.Tensor) -> Nvfp4Columns:
        return Nvfp4Columns(w, scales)

    def modelopt_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {
            "weight": (torch.uint8, (out_dim, in_dim // 2)),
            "weight_scale": (torch.float8_e4m3fn, (out_dim, in_dim // BLOCK_SIZE)),
            "weight_scale_2": (torch.float32, ()),
            "input_scale": (torch.float32, ()),
        }

    def compressed_tensors_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {
            "weight_packed": (torch.uint8, (out_dim, in_dim // 2)),
            "weight_scale": (torch.float8_e4m3fn, (out_dim, in_dim // BLOCK_SIZE)),
            "weight_global_scale": (torch.float32, CT_SCALAR),
            "input_global_scale": (torch.float32, CT_SCALAR),
        }

    def to_compressed_tensors(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "weight_packed": t["weight"],
            "weight_scale": t["weight_scale"],
            "weight_global_scale": (1 / t["weight_scale_2"]).reshape(CT_SCALAR),
            **({"input_global_scale": (1 / t["input_scale"]).reshape(CT_SCALAR)} if self.ct_input_scale_leaf else {}),
        }

    def in_dim_of_stored(self, stored_in_dim: int) -> int:
        return 2 * stored_in_dim  # two codes a byte

    def largest_code(self, largest_block: float | None) -> float:
        return E2M1_MAX * (FP8_E4M3_MAX if largest_block is None else largest_block)


NVFP4 = Nvfp4()
