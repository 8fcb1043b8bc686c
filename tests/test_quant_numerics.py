"""FP8 and NVFP4 numerics against a scalar reference written here from docs/export.md, 'Numerics'.

The reference rounds with explicit value tables and does its fp32 arithmetic with numpy float32
scalars, so it shares no code with eprt.quant.
"""

import math

import numpy as np
import pytest
import torch

from eprt.kernels.cpu_workers import cpu_workers
from eprt.quant import numerics
from eprt.quant.formats.e2m1 import e2m1_decode, e2m1_encode, pack_fp4, unpack_fp4
from eprt.quant.formats.fp8 import dequantize_fp8, fake_quant_fp8, fp8_scale, quantize_fp8
from eprt.quant.formats.nvfp4 import dequantize_nvfp4, fake_quant_nvfp4, nvfp4_block_scales, nvfp4_scale, quantize_nvfp4

F32 = np.float32

# ---------------------------------------------------------------- scalar reference


def _e4m3_table():
    """(value, byte) for every non-negative finite float8_e4m3fn, from the bit layout:
    1 sign, 4 exponent (bias 7), 3 mantissa bits; exponent 0 is subnormal; 0x7F is NaN."""
    table = []
    for byte in range(0x7F):
        e, m = byte >> 3, byte & 7
        value = m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
        table.append((value, byte))
    return table


E4M3 = _e4m3_table()
E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _nearest_even(a, table):
    """Index into the sorted `table` of the value nearest a; a tie goes to the even index."""
    return min(range(len(table)), key=lambda i: (abs(table[i] - a), i % 2))


def ref_e4m3_byte(x: float) -> int:
    """An IEEE-style cast: the sign bit is x's, so -0.0 is 0x80."""
    a = min(abs(x), 448.0)
    byte = E4M3[_nearest_even(a, [v for v, _ in E4M3])][1]
    return byte | (0x80 if math.copysign(1.0, x) < 0 else 0)


def ref_e4m3_value(byte: int) -> float:
    value = dict((b, v) for v, b in E4M3)[byte & 0x7F]
    return -value if byte & 0x80 else value


def ref_e2m1_code(x: float) -> int:
    index = _nearest_even(min(abs(x), 6.0), E2M1)
    return index | (8 if x < 0 else 0)


def ref_decode(code: int) -> float:
    value = E2M1[code & 7]
    return -value if code & 8 else value


def ref_bf16(x: F32) -> float:
    """x rounded to bfloat16, nearest-even, from its fp32 bits: the upper 16 bits are kept."""
    bits = int(np.array(x, dtype=F32).view(np.uint32))
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return float(np.array(bits, dtype=np.uint32).view(F32))


def ref_fp8(w: torch.Tensor, amax: float):
    """ModelOpt's rule: the fp32 quotient is rounded to w's dtype (bf16 or fp32), then to E4M3."""
    scale = F32(amax) / F32(448.0)
    held = ref_bf16 if w.dtype == torch.bfloat16 else float
    flat = [ref_e4m3_byte(held(F32(x) / scale)) for x in w.float().flatten().tolist()]
    return scale, torch.tensor(flat, dtype=torch.uint8).reshape(w.shape)


def ref_nvfp4(w: torch.Tensor, scale_2: float):
    """(packed bytes, block-scale bytes) of a 2-D w, one block at a time."""
    rows = w.float().tolist()
    s2 = F32(scale_2)
    packed, scales = [], []
    for row in rows:
        codes, row_scales = [], []
        for start in range(0, len(row), 16):
            block = [F32(x) for x in row[start : start + 16]]
            amax = max(abs(x) for x in block)
            if amax == 0:
                byte = 0x38  # 1.0
            else:
                ratio = float(amax / (F32(6.0) * s2))
                byte = ref_e4m3_byte(min(max(ratio, 2.0**-9), 448.0))
            row_scales.append(byte)
            denom = F32(ref_e4m3_value(byte)) * s2
            codes += [ref_e2m1_code(float(x / denom)) for x in block]
        packed.append([codes[j] | (codes[j + 1] << 4) for j in range(0, len(codes), 2)])
        scales.append(row_scales)
    return torch.tensor(packed, dtype=torch.uint8), torch.tensor(scales, dtype=torch.uint8)


def u8(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _weights(dtype, shape=(6, 64), seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * torch.logspace(-3, 1, shape[-1])
    w[0, :16] = 0.0  # a zero block
    w[1, 16:32] *= 1e-6  # a block whose scale falls to the 2^-9 floor
    w[2, 3] = -0.0
    return w.to(dtype)


# ---------------------------------------------------------------- FP8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_matches_reference(dtype):
    w = _weights(dtype)
    amax = w.float().abs().max().item()
    scale = fp8_scale(amax)
    ref_scale, ref_bytes = ref_fp8(w, amax)
    assert scale.dtype == torch.float32 and scale.shape == ()
    assert scale.item() == float(ref_scale)
    q = quantize_fp8(w, scale)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape
    assert torch.equal(u8(q), ref_bytes)


def test_fp8_ties_saturation_and_subnormals():
    # With scale 1 the quantized value is w itself.
    cases = {
        1.0 + 1 / 16: 0x38,  # tie between 1 and 1.125: even mantissa, 1.0
        1.0 + 3 / 16: 0x3A,  # tie between 1.125 and 1.25: 1.25
        2.5 * 2.0**-9: 0x02,  # subnormal tie between 2 and 3 * 2^-9: 2
        3.5 * 2.0**-9: 0x04,  # subnormal tie between 3 and 4 * 2^-9: 4
        0.4 * 2.0**-9: 0x00,  # below half the smallest subnormal: zero
        448.0: 0x7E,
        460.0: 0x7E,  # beyond 448, below the next binade: saturates
        1e6: 0x7E,  # far beyond: saturates rather than NaN
        -1e6: 0xFE,
        -3.0: 0xC4,  # 1.5 * 2^1: exponent 8, mantissa 4
        -0.0: 0x80,  # the sign of zero is kept, as in an IEEE cast
        -1e-9: 0x80,  # rounds to negative zero
    }
    w = torch.tensor(list(cases), dtype=torch.float32)
    assert u8(quantize_fp8(w, 1.0)).tolist() == list(cases.values())


def test_fp8_dequantize_and_fake_quant():
    w = _weights(torch.bfloat16)
    scale = fp8_scale(w.float().abs().max())
    q = quantize_fp8(w, scale)
    expected = torch.tensor([ref_e4m3_value(b) * float(scale) for b in u8(q).flatten().tolist()])
    assert torch.equal(dequantize_fp8(q, scale), expected.reshape(w.shape).float())
    fake = fake_quant_fp8(w, scale)
    assert fake.dtype == torch.bfloat16
    assert torch.equal(fake, expected.reshape(w.shape).to(torch.bfloat16))


def test_fp8_zero_amax_and_bad_amax():
    assert fp8_scale(0.0).item() == 1.0
    scale = fp8_scale(torch.zeros(4, 4).abs().max())
    assert torch.equal(u8(quantize_fp8(torch.zeros(4, 4), scale)), torch.zeros(4, 4, dtype=torch.uint8))
    # A positive but tiny amax keeps a scale whose fp32 reciprocal is finite.
    assert torch.isfinite(torch.reciprocal(fp8_scale(1e-40)))
    for bad in (float("nan"), float("inf"), -1.0):
        with pytest.raises(ValueError, match="amax"):
            fp8_scale(bad)
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_fp8(torch.tensor([1.0, float("nan")]), 1.0)


# ---------------------------------------------------------------- E2M1 and packing


def test_e2m1_ties_negatives_and_saturation():
    # value -> code, from docs/export.md's tie list and the code layout [0,.5,1,1.5,2,3,4,6] + sign.
    cases = {
        0.25: 0,
        0.75: 2,
        1.25: 2,
        1.75: 4,
        2.5: 4,
        3.5: 6,
        5.0: 6,
        0.2: 0,
        0.3: 1,
        2.9: 5,
        5.5: 7,
        6.0: 7,
        6.5: 7,
        100.0: 7,
        -0.25: 8,
        -0.75: 10,
        -1.25: 10,
        -1.75: 12,
        -2.5: 12,
        -3.5: 14,
        -5.0: 14,
        -0.1: 8,
        -6.0: 15,
        -7.0: 15,
        0.0: 0,
    }
    x = torch.tensor(list(cases), dtype=torch.float32)
    assert e2m1_encode(x).tolist() == list(cases.values())
    assert e2m1_encode(x).tolist() == [ref_e2m1_code(v) for v in cases]
    # -0.0 is not below zero: code 0, as ModelOpt's `weight < 0` sign test gives.
    assert e2m1_encode(torch.tensor([-0.0])).tolist() == [0]


def test_e2m1_decode_table():
    values = e2m1_decode(torch.arange(16, dtype=torch.uint8))
    assert values.tolist() == E2M1 + [-v for v in E2M1]
    assert math.copysign(1.0, values[8].item()) == -1.0


def test_pack_nibble_order():
    codes = torch.tensor([[2, 4, 15, 0, 7, 9]], dtype=torch.uint8)
    packed = pack_fp4(codes)
    assert packed.tolist() == [[0x42, 0x0F, 0x97]]
    every_byte = torch.arange(256, dtype=torch.uint8).reshape(4, 64)
    assert torch.equal(pack_fp4(unpack_fp4(every_byte)), every_byte)
    assert unpack_fp4(torch.tensor([0xA3], dtype=torch.uint8)).tolist() == [3, 10]


# ---------------------------------------------------------------- NVFP4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_nvfp4_matches_reference(dtype):
    w = _weights(dtype)
    amax = w.float().abs().max().item()
    scale_2 = nvfp4_scale(amax)
    assert scale_2.dtype == torch.float32 and scale_2.shape == ()
    assert scale_2.item() == float(F32(amax) / F32(6.0 * 448.0))
    packed, block_scale = quantize_nvfp4(w, scale_2)
    ref_packed, ref_scales = ref_nvfp4(w, scale_2.item())
    assert packed.dtype == torch.uint8 and packed.shape == (6, 32)
    assert block_scale.dtype == torch.float8_e4m3fn and block_scale.shape == (6, 4)
    assert torch.equal(u8(block_scale), ref_scales)
    assert torch.equal(packed, ref_packed)


def test_nvfp4_shared_scale_2_and_stacked_experts():
    # A weight_scale_2 from a larger amax (gate/up share one), and [E, out, in] in one call.
    w = torch.stack([_weights(torch.bfloat16, seed=s) for s in (1, 2)])
    scale_2 = nvfp4_scale(3.0 * w.float().abs().max())
    packed, block_scale = quantize_nvfp4(w, scale_2)
    assert packed.shape == (2, 6, 32) and block_scale.shape == (2, 6, 4)
    for e in range(2):
        ref_packed, ref_scales = ref_nvfp4(w[e], scale_2.item())
        assert torch.equal(packed[e], ref_packed)
        assert torch.equal(u8(block_scale[e]), ref_scales)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("workers", [1, 3])
def test_chunked_quantization_matches_reference(dtype, workers, monkeypatch):
    # On CPU the quantizers walk a weight a chunk at a time, on one thread or on several that
    # take whole chunks; chunk edges, a shorter last chunk included, change no byte, and a NaN
    # in the last chunk is still refused.
    monkeypatch.setattr(numerics, "CHUNK_ELEMENTS", 5 * 64)  # NVFP4: rows 0-4, 5-9, 10-11; FP8: 320, 320, 128
    w = torch.stack([_weights(dtype, seed=s) for s in (3, 4)])
    amax = w.float().abs().max().item()
    threads = torch.get_num_threads()
    with cpu_workers(workers):
        assert torch.get_num_threads() == 1  # the workers, not torch's own threads, split the work
        packed, block_scale = quantize_nvfp4(w, nvfp4_scale(amax))
        q = quantize_fp8(w, fp8_scale(amax))
        for e in range(2):
            ref_packed, ref_scales = ref_nvfp4(w[e], nvfp4_scale(amax).item())
            assert torch.equal(packed[e], ref_packed) and torch.equal(u8(block_scale[e]), ref_scales)
            assert torch.equal(u8(q[e]), ref_fp8(w[e], amax)[1])
        w[1, -1, -1] = float("nan")
        with pytest.raises(ValueError, match="NaN or infinite"):
            quantize_fp8(w, 1.0)
        with pytest.raises(ValueError, match="NaN or infinite"):
            quantize_nvfp4(w, 1.0)
    assert torch.get_num_threads() == threads


def _one_block(values, fill=0.0):
    return torch.tensor(list(values) + [fill] * (16 - len(values)), dtype=torch.float32)[None]


def test_nvfp4_ties_through_quantize():
    # block amax 6 with scale_2 1: block scale 6/(6*1) = 1, so the E2M1 input is w itself.
    w = _one_block([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.75, -5.0, -0.2, -0.0, 1.0, 2.0])
    packed, block_scale = quantize_nvfp4(w, 1.0)
    assert u8(block_scale).tolist() == [[0x38]]
    codes = unpack_fp4(packed)[0].tolist()
    assert codes[:14] == [7, 0, 2, 2, 4, 4, 6, 6, 10, 14, 8, 0, 2, 4]
    assert packed[0, 6].item() == 0x42  # elements 12 (1.0, code 2) and 13 (2.0, code 4)


def test_nvfp4_block_scale_edges():
    # scale_2 = 1, so block scale = e4m3(clamp(block_amax / 6, 2^-9, 448)) and the block-amax
    # element is quantized as block_amax / block_scale.
    rows = {
        # block amax: (block scale byte, code of the block-amax element)
        0.0: (0x38, 0),  # zero block: scale 1.0
        6 * 2.0**-11: (0x01, 3),  # 2^-11 clamps to 2^-9; 6*2^-11 / 2^-9 = 1.5
        6 * 3 * 2.0**-9: (0x03, 7),  # exact e4m3 subnormal 3 * 2^-9; 6
        6 * 2.5 * 2.0**-9: (0x02, 7),  # subnormal tie to even, 2 * 2^-9; 7.5 saturates to 6
        6 * 3.5 * 2.0**-9: (0x04, 7),  # subnormal tie to even, 4 * 2^-9; 5.25 rounds to 6
        6 * 448.0 * 2: (0x7E, 7),  # 896 clamps to 448; 5376 / 448 = 12 saturates to 6
    }
    w = torch.cat([_one_block([a]) for a in rows])
    packed, block_scale = quantize_nvfp4(w, 1.0)
    assert u8(block_scale)[:, 0].tolist() == [b for b, _ in rows.values()]
    assert unpack_fp4(packed)[:, 0].tolist() == [c for _, c in rows.values()]
    ref_packed, ref_scales = ref_nvfp4(w, 1.0)
    assert torch.equal(packed, ref_packed) and torch.equal(u8(block_scale), ref_scales)


def test_nvfp4_rounding_order():
    # fp32 operands found by search where the order of operations in docs/export.md, 'Numerics', matters.
    # block_amax / (6*s2) lands on the e4m3 value 1.5 (0x3C); block_amax / 6 / s2 lands one ulp
    # above the tie 1.5625 and would give 0x3D.
    s2 = 0.0008675210410729051
    packed, block_scale = quantize_nvfp4(_one_block([0.008133010007441044]), s2)
    assert u8(block_scale).tolist() == [[0x3C]]
    # With block scale 3 (0x44): w / (3*s2) is the tie 5.0 and goes to 4 (code 6); w / 3 / s2 is
    # one ulp above 5 and would give 6 (code 7).
    s2 = 0.007083086762577295
    w = _one_block([0.12749555706977844, 0.10624630749225616])
    packed, block_scale = quantize_nvfp4(w, s2)
    assert u8(block_scale).tolist() == [[0x44]]
    assert unpack_fp4(packed)[0, :2].tolist() == [7, 6]
    assert torch.equal(packed, ref_nvfp4(w, s2)[0])


def test_nvfp4_dequantize_and_fake_quant():
    w = _weights(torch.bfloat16)
    scale_2 = nvfp4_scale(w.float().abs().max())
    packed, block_scale = quantize_nvfp4(w, scale_2)
    codes = unpack_fp4(packed)
    scales = block_scale.float().repeat_interleave(16, dim=-1)
    expected = torch.tensor(
        [
            [float(F32(ref_decode(c) * s) * F32(scale_2.item())) for c, s in zip(crow, srow)]
            for crow, srow in zip(codes.tolist(), scales.tolist())
        ]
    )
    assert torch.equal(dequantize_nvfp4(packed, block_scale, scale_2), expected)
    fake = fake_quant_nvfp4(w, scale_2)
    assert fake.dtype == torch.bfloat16 and torch.equal(fake, expected.to(torch.bfloat16))


def test_nvfp4_zero_weight_and_refusals():
    assert nvfp4_scale(0.0).item() == float(F32(1.0) / F32(448.0))
    w = torch.zeros(2, 32, dtype=torch.bfloat16)
    scale_2 = nvfp4_scale(w.float().abs().max())
    packed, block_scale = quantize_nvfp4(w, scale_2)
    assert torch.equal(packed, torch.zeros(2, 16, dtype=torch.uint8))
    assert torch.equal(u8(block_scale), torch.full((2, 2), 0x38, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\(4, 24\).*multiple of 16"):
        quantize_nvfp4(torch.ones(4, 24), 1.0)
    with pytest.raises(ValueError, match="NaN or infinite"):
        quantize_nvfp4(torch.full((1, 16), float("inf")), 1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_no_rows_quantize_to_no_rows(dtype):
    """A rank given no rows in a step (its share of a layout) quantizes an empty [0, in] input,
    in both formats, to empty outputs of the right widths."""
    x, scale = torch.empty(0, 32, dtype=dtype), torch.tensor(0.01)
    q, block_scale = quantize_nvfp4(x, scale)
    assert (q.shape, block_scale.shape) == ((0, 16), (0, 2))
    assert fake_quant_nvfp4(x, scale).shape == (0, 32)
    assert quantize_fp8(x, scale).shape == (0, 32)
    assert fake_quant_fp8(x, scale).shape == (0, 32)


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_nvfp4_fake_quant_is_dequantize_of_quantize_bitwise(dtype, workers):
    """The one-pass quantize-dequantize gives the bits of decoding the export's codes, signs of
    zero included, with the block-amax rule and with block scales given, in any output dtype,
    in chunks on any number of workers."""
    g = torch.Generator().manual_seed(3)
    # magnitudes over 30 decades, exact zeros, negative zeros and values that round to -0
    x = (torch.randn(300, 256, generator=g, dtype=torch.float64) * torch.logspace(-30, 3, 256, dtype=torch.float64)).to(
        dtype
    )
    x.view(-1)[::7], x.view(-1)[::11] = -0.0, 0.0
    x.view(-1)[::13] *= 1e-4
    amax = x.double().abs().max()
    given = nvfp4_block_scales(x * 0.5, nvfp4_scale(amax))
    with cpu_workers(workers):
        for scale_2, block_scale in ((nvfp4_scale(amax), None), (nvfp4_scale(1e-20), None), (nvfp4_scale(amax), given)):
            packed, used = quantize_nvfp4(x, scale_2, block_scale)
            for out_dtype in (None, torch.float32):
                want = dequantize_nvfp4(packed, used, scale_2, dtype=out_dtype or dtype)
                got = fake_quant_nvfp4(x, scale_2, block_scale, dtype=out_dtype)
                assert got.dtype == want.dtype and torch.equal(got, want)
                assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("workers", [1, 2])
def test_segment_amax_is_each_experts_abs_max(workers):
    """Each expert's largest magnitude over its rows alone (on CPU one expert a worker), 0 for an
    expert given none, and +0.0 for rows that are all negative zeros."""
    from eprt.quant.loop.calibrate import segment_amax

    g = torch.Generator().manual_seed(4)
    tokens = torch.tensor([3, 0, 5, 1, 0, 4])
    x = torch.randn(int(tokens.sum()), 40, generator=g).bfloat16()
    x[8] = -0.0  # expert 3's only row
    x[2, 5] = -9.0  # expert 0's largest magnitude is negative
    with cpu_workers(workers):
        got = segment_amax(x, tokens)
    want = torch.zeros(len(tokens))
    for e, rows in enumerate(x.split(tokens.tolist())):
        if rows.shape[0]:
            want[e] = rows.float().abs().max()
    assert got.dtype == torch.float32 and torch.equal(got, want)
    assert not torch.signbit(got).any()
    assert torch.equal(segment_amax(x[:0], torch.zeros(3, dtype=torch.int64)), torch.zeros(3))
