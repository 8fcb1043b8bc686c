"""MXFP4 weights only: E2M1 codes with an E8M0 (power-of-two) scale per 32 elements along the input
dim, inputs left unquantized: the layout Kimi-K3 ships its routed experts in (compressed-tensors'
`mxfp4-pack-quantized`), which Blackwell engines run as FP4 weights against bf16 activations
(vLLM's compressed-tensors MXFP4 path; docs/export.md, 'MXFP4').

A block's scale is 2^(floor(log2(amax)) - 2) with amax first rounded to E2M1's precision, the OCP MX
rule as compressed-tensors computes it (`generate_mx_scales`, llm-compressor's;
eprt.quant.formats.e8m0.ocp_exponents): a block whose amax lies between 6 and 7 times that scale has
its top values clipped to 6, for a grid up to twice as fine as 2^ceil(log2(amax / 6)) (nothing
clipped) would give it (docs/quality.md, "MXFP4's scale"). A code is fp32(w) times 2^-exponent (exact)
rounded to E2M1 nearest with ties to even (eprt.quant.formats.e2m1, NVFP4's codes; -0.0 keeps its
sign bit, as compressed-tensors packs it), two a byte, the even element in the low nibble. On the
values of any MXFP4 weight both rules give the weight's own scales, so a source stored in this
format (Kimi-K3's) gets back its own scales and bytes in every block that reaches 4 or 6 times its
scale. `mse` chooses each block's exponent between the one that clips nothing and the one below.
Only compressed-tensors' layout exists: ModelOpt's export has no MXFP4 weights-only algorithm an
engine reads, so the ModelOpt layout is refused by name.
"""

from __future__ import annotations

import torch

from eprt.quant.formats.base import Tensors
from eprt.quant.formats.e2m1 import (
    E2M1_MANTISSA_BITS,
    E2M1_MAX,
    PAIR_CODES,
    PAIR_OFFSET,
    Q,
    e2m1_decode,
    e2m1_encode_signed_zero,
    pack_fp4,
    quarter_keys,
    unpack_fp4,
)
from eprt.quant.formats.e8m0 import (
    BLOCK,
    Microscaled,
    check_shape,
    checked_amax,
    checked_scales,
    ocp_exponents,
    scaled_down,
    scaled_up,
)
from eprt.quant.numerics import CHUNK_ELEMENTS, chunk_buffer, for_chunks, row_chunks

NEGATIVE_ZERO = -(2**31)  # the bits of fp32 -0.0 read as an int32


def mxfp4_scales(w: torch.Tensor) -> torch.Tensor:
    """uint8 E8M0 scales [..., in/32] of w [..., in] by the OCP rule (`ocp_exponents`). Raises
    ValueError for a weight holding NaN or infinity."""
    return ocp_exponents(checked_amax(w), E2M1_MAX, E2M1_MANTISSA_BITS)


def quantize_mxfp4(w: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Packed E2M1 codes uint8 [..., in/2] of w [..., in] under its E8M0 scales, a chunk of rows at
    a time through buffers kept from call to call (eprt.quant.numerics.chunk_buffer)."""
    rows, grid = w.reshape(-1, w.shape[-1]), scales.reshape(-1, scales.shape[-1])
    n, width = rows.shape
    packed = torch.empty(n, width // 2, dtype=torch.uint8, device=w.device)
    step, chunks = row_chunks(n, width, w.device)

    def buffers() -> tuple[torch.Tensor, ...]:
        return tuple(chunk_buffer(f"mxfp4.{slot}", (step, width), torch.float32, w.device) for slot in ("x", "keys"))

    def chunk(a: int, b: int, kept: tuple[torch.Tensor, ...]) -> None:
        x, keys = (t[: b - a] for t in kept)
        scaled_down(x.copy_(rows[a:b]), grid[a:b], in_place=True)
        # -0.0's bits are the least int32: only a chunk holding one needs its sign bit set apart
        if x.view(torch.int32).min().item() == NEGATIVE_ZERO:
            packed[a:b] = pack_fp4(e2m1_encode_signed_zero(x))
        else:
            packed_codes(x, keys, out=packed[a:b])

    for_chunks(chunks, buffers, chunk, w.device)
    return packed.reshape(*w.shape[:-1], width // 2)


def packed_codes(x: torch.Tensor, keys: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """Into uint8 `out` [n, in/2]: the packed E2M1 codes of fp32 x [n, in] (holding no -0.0), which
    it overwrites, as it does fp32 `keys` [n, in]: the byte of each pair of elements looked up at
    once by both their quarter keys."""
    keys = quarter_keys(x.mul_(4), keys)  # 4x: exact, a power of two
    pairs = keys.view(*x.shape[:-1], x.shape[-1] // 2, 2)
    # each pair's index into x's first half columns (x is spent), then widened to int32
    index = torch.add(pairs[..., 0], pairs[..., 1], alpha=4 * Q, out=x[..., : x.shape[-1] // 2]).add_(PAIR_OFFSET)
    index = index.to(torch.int32)
    return torch.index_select(PAIR_CODES.to(x.device), 0, index.reshape(-1), out=out.view(-1))


def e2m1_values(quotient: torch.Tensor) -> torch.Tensor:
    """fp32 values of the E2M1 codes nearest fp32 `quotient`, as `quantize_mxfp4` encodes it: -0.0
    and a negative value that rounds to zero are -0.0 (code 8)."""
    return e2m1_decode(e2m1_encode_signed_zero(quotient))


def dequantize_mxfp4(packed: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The values of packed codes [..., in/2] times their block's scale, in fp32, returned as `dtype`."""
    check_shape(scales, packed, 2 * packed.shape[-1], "MXFP4")
    return scaled_up(e2m1_decode(unpack_fp4(packed)), scales).to(dtype)


class Mxfp4(Microscaled):
    """E2M1 weights in blocks of 32 with E8M0 scales; bf16 inputs."""

    name = "mxfp4"
    quant_algo = "MXFP4"  # how messages name it: ModelOpt's export has no such algorithm (`modelopt_layout`)
    num_bits = 4
    modelopt_layout = False
    ct_preset, ct_format = "MXFP4A16", "mxfp4-pack-quantized"
    # the packed codes (1/2), the blocks' fp32 amax and the exponent rule's two fp32 temporaries
    # (3 x 4 a block of 32), and a scale byte a block: the quotient, its keys and the pairs' index
    # live in each thread's three fp32 chunk buffers (the block amax's, the quotient's, the keys')
    export_working_bytes = 1 / 2 + (3 * 4 + 1) / BLOCK
    export_worker_bytes = 3 * 4 * CHUNK_ELEMENTS

    scales_of = staticmethod(mxfp4_scales)
    encode = staticmethod(quantize_mxfp4)
    decode = staticmethod(dequantize_mxfp4)
    round_quotient = staticmethod(e2m1_values)

    def mse_candidates(self, w: torch.Tensor) -> list[torch.Tensor]:
        # the exponent that clips nothing (ceil(log2(amax / 6))) and the one below, max's (the OCP
        # rule's) always one of them; one further below clips more than its finer steps give back.
        # A tie keeps the first, as the search chose before max took the OCP rule.
        scales = checked_scales(w, E2M1_MAX)
        return [scales, scales.clamp(min=1).sub_(1)]

    def fake_quantize_input(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x  # the engine computes with the inputs as they come

    def modelopt_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        # the weights' tensors as eprt holds them between quantization and export (never written
        # in the ModelOpt layout, which is refused)
        return {
            "weight": (torch.uint8, (out_dim, in_dim // 2)),
            "weight_scale": (torch.uint8, (out_dim, in_dim // BLOCK)),
        }

    def compressed_tensors_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {
            "weight_packed": (torch.uint8, (out_dim, in_dim // 2)),
            "weight_scale": (torch.uint8, (out_dim, in_dim // BLOCK)),
        }

    def to_compressed_tensors(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {"weight_packed": t["weight"], "weight_scale": t["weight_scale"]}

    def in_dim_of_stored(self, stored_in_dim: int) -> int:
        return 2 * stored_in_dim

    def modelopt_input_group(self) -> dict | None:
        return None

    def largest_code(self, largest_block: float | None) -> float:
        return E2M1_MAX


MXFP4 = Mxfp4()
