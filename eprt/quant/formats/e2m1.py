"""E2M1, the 4-bit float of NVFP4 (and of the MX formats): codes, their values and their packing.

An E2M1 code has the sign in bit 3 and an index into E2M1_VALUES in bits 0-2; two codes share a
byte, the even element in the low nibble. Rounding is to nearest with ties to the even index,
saturating at +-6, and the sign bit is set for values below zero, as ModelOpt's `_cast_fp4` does
(`weight < 0`): a negative value that rounds to zero is code 8 (negative zero), an input of -0.0
is code 0 (compressed-tensors, whose MXFP4 eprt writes, keeps -0.0's sign: `e2m1_encode_signed_zero`).
"""

import torch

E2M1_MAX = 6.0
E2M1_MANTISSA_BITS = 1
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

# Every E2M1 midpoint (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5) is a whole number of quarters, so the
# code of x depends only on floor(4x) and on whether 4x lies strictly above it: no midpoint falls
# inside (n, n+1), and at n itself the tie is decided once, here. `QUARTER_CODES[2*(n+Q) + above]`
# holds those codes for n in [-Q, Q), built by the rounding rule spelled out on the values
# themselves (beyond +-6.5 every code saturates).
Q = 26


def _code_of(v: float) -> int:
    """The E2M1 code of one value: nearest, a tie to the even index, saturating; sign set below zero."""
    a = min(abs(v), E2M1_MAX)
    index = min(range(len(E2M1_VALUES)), key=lambda i: (abs(E2M1_VALUES[i] - a), i % 2))
    return index | (8 if v < 0 else 0)


QUARTER_CODES = torch.tensor(
    [_code_of((n + above / 2) / 4) for n in range(-Q, Q) for above in (0, 1)], dtype=torch.uint8
)


# The packed byte of two neighbouring codes, by both their keys: `PAIR_CODES[k0 + 4Q*k1]`
# (keys counted from 0), so a pair of elements is packed by the same lookup that encodes it.
PAIR_CODES = (QUARTER_CODES[None, :] | (QUARTER_CODES[:, None] << 4)).reshape(-1)
PAIR_OFFSET = 2 * Q * (1 + 4 * Q)  # of a pair's signed keys


def quarter_keys(f: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Into fp32 `out`: 2n + (f > n) for n = floor(f) of fp32 `f` (4x, exact), which it
    overwrites: a table lookup per element instead of a comparison per midpoint. floor(f) +
    ceil(f) is 2n at f = n and 2n+1 inside (n, n+1); clamping to [-Q, Q-1] first keeps both where
    every code saturates, so the keys lie in [-2Q, 2Q)."""
    f.clamp_(-Q, Q - 1)
    return torch.floor(f, out=out).add_(f.ceil_())


def encode_quarters(f: torch.Tensor) -> torch.Tensor:
    """E2M1 codes of f/4 for fp32 `f` (4x, exact), which it overwrites."""
    key = quarter_keys(f, torch.empty_like(f)).to(torch.int32).add_(2 * Q)
    return QUARTER_CODES.to(f.device).index_select(0, key.reshape(-1)).reshape(f.shape)


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """uint8 E2M1 codes (0..15) of finite x, rounded to nearest with ties to even, saturating at +-6."""
    return encode_quarters(x.float() * 4)


def e2m1_encode_signed_zero(x: torch.Tensor) -> torch.Tensor:
    """`e2m1_encode`, with the sign bit of -0.0 kept (code 8), as compressed-tensors packs codes
    (`torch.signbit`): an MXFP4 source's negative zeros, decoded and encoded again, come back as
    they were stored."""
    return e2m1_encode(x).bitwise_or_(torch.signbit(x).to(torch.uint8) << 3)


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
PAIR_VALUES = e2m1_decode(unpack_fp4(torch.arange(256, dtype=torch.uint8).view(256, 1)))
# The value of every quarter key (counted from 0), for quantize-dequantize in one pass.
QUARTER_VALUES = e2m1_decode(QUARTER_CODES)
