"""NVFP4 quantization, byte-exact to the ModelOpt Hugging Face export (docs/export.md, 'Numerics').

Two-level scaling over blocks of 16 consecutive elements along the last (input) dim:
  weight_scale_2 = w_amax / (6*448)                                   fp32 0-dim
  block_scale    = e4m3(clamp(block_amax / (6*weight_scale_2), 2^-9, 448)), 1.0 for a zero block
  code           = E2M1(w / (float(block_scale) * weight_scale_2)), ties to even, saturating at 6
An E2M1 code has the sign in bit 3 and an index into E2M1_VALUES in bits 0-2; two codes share a
byte, the even element in the low nibble. input_scale = in_amax / (6*448) has the weight_scale_2
formula, and activations are quantized by the same block rule at run time.

The sign bit is set for values below zero, as ModelOpt's `_cast_fp4` does (`weight < 0`): a
negative value that rounds to zero is code 8 (negative zero), an input of -0.0 is code 0.

Zero amax gives scale 1/448, and scales have a floor: see `eprt.quant.numerics`.
"""

import torch
import torch.nn.functional as F

from eprt.quant.numerics import (FP8_E4M3_MAX, as_scale, check_finite, chunk_buffer, e4m3_values, for_chunks,
                                 per_tensor_scale, row_chunks, to_e4m3)

BLOCK_SIZE = 16
E2M1_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Smallest block scale: the smallest E4M3 subnormal, so no block scale is ever zero.
MIN_BLOCK_SCALE = 2.0**-9
# Weight dtypes divided by an fp32 block scale as they are: torch widens them to fp32 exactly.
WIDENED = (torch.float32, torch.bfloat16, torch.float16)


def nvfp4_scale(amax) -> torch.Tensor:
    """NVFP4 per-tensor scale (weight_scale_2, input_scale): fp32 0-dim amax/(6*448).

    `amax` is a Python number or a one-element tensor; amax == 0 gives 1/448.
    """
    return per_tensor_scale(amax, E2M1_MAX * FP8_E4M3_MAX, zero_amax=E2M1_MAX)


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

    for_chunks(chunks, lambda: chunk_buffer("nvfp4.amax", (step, rows.shape[1]), torch.float32, x.device),
               block_amax, x.device)
    return amax.reshape(*x.shape[:-1], blocks)


def _block_scales(block_amax: torch.Tensor, scale_2: torch.Tensor) -> torch.Tensor:
    scale = (block_amax / (E2M1_MAX * scale_2)).clamp(MIN_BLOCK_SCALE, FP8_E4M3_MAX)
    # Chosen in fp32 (1.0 is exact in E4M3): not every device has float8 kernels for `where`.
    return to_e4m3(torch.where(block_amax == 0, 1.0, scale))


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) of finite x, rounded to nearest with ties to even, saturating at +-6."""
    return _encode_quarters(x.float() * 4)


# Every E2M1 midpoint (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is a whole number of quarters, so the
# code of x depends only on floor(4x) and on whether 4x lies strictly above it: no midpoint falls
# inside (n, n+1), and at n itself the tie is decided once, here. `_QUARTER_CODES[2*(n+Q) + above]`
# holds those codes for n in [-Q, Q), built by the rounding rule spelled out on the values
# themselves (beyond +-6.5 every code saturates).
_Q = 26


def _code_of(v: float) -> int:
    """The E2M1 code of one value: nearest, a tie to the even index, saturating; sign set below zero."""
    a = min(abs(v), E2M1_MAX)
    index = min(range(len(E2M1_VALUES)), key=lambda i: (abs(E2M1_VALUES[i] - a), i % 2))
    return index | (8 if v < 0 else 0)


_QUARTER_CODES = torch.tensor([_code_of((n + above / 2) / 4) for n in range(-_Q, _Q) for above in (0, 1)],
                              dtype=torch.uint8)


# The packed byte of two neighbouring codes, by both their keys: `_PAIR_CODES[k0 + 4Q*k1]`
# (keys counted from 0), so a pair of elements is packed by the same lookup that encodes it.
_PAIR_CODES = (_QUARTER_CODES[None, :] | (_QUARTER_CODES[:, None] << 4)).reshape(-1)
_PAIR_OFFSET = 2 * _Q * (1 + 4 * _Q)  # of a pair's signed keys


def _quarter_keys(f: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Into fp32 `out`: 2n + (f > n) for n = floor(f) of fp32 `f` (4x, exact), which it
    overwrites: a table lookup per element instead of a comparison per midpoint. floor(f) +
    ceil(f) is 2n at f = n and 2n+1 inside (n, n+1); clamping to [-Q, Q-1] first keeps both where
    every code saturates, so the keys lie in [-2Q, 2Q)."""
    f.clamp_(-_Q, _Q - 1)
    return torch.floor(f, out=out).add_(f.ceil_())


def _encode_quarters(f: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of f/4 for fp32 `f` (4x, exact), which it overwrites."""
    key = _quarter_keys(f, torch.empty_like(f)).to(torch.int32).add_(2 * _Q)
    return _QUARTER_CODES.to(f.device).index_select(0, key.reshape(-1)).reshape(f.shape)


def _rows_of(w: torch.Tensor) -> torch.Tensor:
    """w [..., in] as rows [n, in] the quotient divides as they are: float8 (torch divides it by
    nothing) and float64 as their fp32 values."""
    return (w if w.dtype in WIDENED else w.float()).reshape(-1, w.shape[-1])


def _for_key_chunks(rows: torch.Tensor, denom: torch.Tensor, slots: tuple, body) -> None:
    """body(a, b, key, f, bufs) for every chunk [a, b) of rows [n, in] (eprt.quant.numerics.row_chunks):
    `key` the chunk's quarter keys (`_quarter_keys`) under its blocks' denominators `denom`
    [n, in/16, 1] (block scale * scale_2), of the quotient in fp32 (ModelOpt's: widened exactly,
    then divided) times 4 (exact: a power of two), held in `f`, which body may overwrite;
    `bufs` this thread's kept buffers of `slots` ((name, divisor of in, dtype)) for the chunk."""
    n, width = rows.shape
    step, chunks = row_chunks(n, width, rows.device)
    slots = (("quotient", 1, torch.float32), ("keys", 1, torch.float32), *slots)

    def buffers() -> tuple[torch.Tensor, ...]:
        return tuple(chunk_buffer(f"nvfp4.{slot}", (step, width // part), dtype, rows.device)
                     for slot, part, dtype in slots)

    def chunk(a: int, b: int, kept: tuple[torch.Tensor, ...]) -> None:
        f, keys, *bufs = (t[: b - a] for t in kept)
        # widened into f first, then divided in place: a division of bf16 by fp32 would widen
        # into a fresh temporary of its own each chunk
        _as_blocks(f.copy_(rows[a:b])).div_(denom[a:b])
        body(a, b, _quarter_keys(f.mul_(4), keys), f, bufs)

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
    table = _PAIR_CODES.to(w.device)

    def encode(a: int, b: int, key: torch.Tensor, _f, bufs: list[torch.Tensor]) -> None:
        pair_keys, pair_index = bufs
        key = key.view(b - a, -1, 2)
        pair = torch.add(key[..., 0], key[..., 1], alpha=4 * _Q, out=pair_keys).add_(_PAIR_OFFSET)
        torch.index_select(table, 0, pair_index.copy_(pair).view(-1), out=packed[a:b].view(-1))

    _for_key_chunks(rows, denom, (("pair_keys", 2, torch.float32), ("pair_index", 2, torch.int32)), encode)
    return packed.reshape(*w.shape[:-1], width // 2)


_E2M1_SIGNED = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES), dtype=torch.float32)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of uint8 E2M1 codes (0..15); code 8 is -0.0."""
    index = codes.reshape(-1).to(torch.int32)
    return _E2M1_SIGNED.to(codes.device).index_select(0, index).view(codes.shape)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [..., n/2] from codes [..., n]: element 2j in the low nibble, 2j+1 in the high one."""
    if codes.shape[-1] % 2 != 0:
        raise ValueError(f"packing two FP4 codes a byte needs an even last dim, got shape {tuple(codes.shape)}")
    if codes.dtype != torch.uint8 or not codes.is_contiguous():
        codes = codes.to(torch.uint8).contiguous()
    # Each pair of codes read as one little-endian int16 is c0 + 256*c1 (codes < 16), so
    # (v | v >> 4) holds c0 | c1 << 4 in its low byte: one pass, not two strided ones.
    pairs = codes.view(torch.int16)
    return (pairs >> 4).bitwise_or_(pairs).bitwise_and_(0xFF).to(torch.uint8)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 codes [..., 2n] from packed uint8 [..., n]; inverse of `pack_fp4`."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1)
    return codes.reshape(*packed.shape[:-1], 2 * packed.shape[-1])


# Both values of every packed byte, the low nibble's first: a byte decodes by one lookup, through
# an int32 index (an int64 one would be twice the size of the fp32 values it fetches).
_PAIR_VALUES = e2m1_decode(unpack_fp4(torch.arange(256, dtype=torch.uint8).view(256, 1)))
# The value of every quarter key (counted from 0), for quantize-dequantize in one pass.
_QUARTER_VALUES = e2m1_decode(_QUARTER_CODES)


def quantize_nvfp4(w: torch.Tensor, scale_2, block_scale: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(weight uint8 [..., in/2], weight_scale float8_e4m3fn [..., in/16]) for w [..., in].

    `scale_2` is the fp32 per-tensor weight_scale_2 (from `nvfp4_scale`; shared by fused
    projections, so it may come from a larger amax than w's own). Any leading dims are kept, so
    stacked experts [E, out, in] quantize in one call. Computed in fp32 whatever w's dtype.
    `block_scale` (float8_e4m3fn [..., in/16], positive): block scales chosen elsewhere (the
    `mse` search, eprt.quant.mse) instead of the block-amax rule above.
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
        raise ValueError(f"block scales {block_scale.dtype} {tuple(block_scale.shape)} do not fit weight "
                         f"{tuple(w.shape)}: expected float8_e4m3fn {tuple(block_amax.shape)}")
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
    return _encode_quarters(quarters).reshape(w.shape)


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
    values = _PAIR_VALUES.to(packed.device).index_select(0, index).view(*blocks_shape, BLOCK_SIZE)
    values.mul_(e4m3_values(block_scale).unsqueeze(-1)).mul_(as_scale(scale_2, packed.device))
    return values.view(*packed.shape[:-1], width).to(dtype)


def fake_quant_nvfp4(x: torch.Tensor, scale_2, block_scale: torch.Tensor | None = None,
                     dtype: torch.dtype | None = None) -> torch.Tensor:
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
    table = _QUARTER_VALUES.to(x.device)

    def fake(a: int, b: int, key: torch.Tensor, f: torch.Tensor, bufs: list[torch.Tensor]) -> None:
        index, = bufs
        torch.index_select(table, 0, index.copy_(key).add_(2 * _Q).view(-1), out=f.view(-1))
        out_rows[a:b] = _as_blocks(f).mul_(block[a:b]).mul_(scale_2).view(b - a, width)

    _for_key_chunks(rows, block * scale_2, (("value_index", 1, torch.int32),), fake)
    return out
