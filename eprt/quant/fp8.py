"""FP8 E4M3 per-tensor quantization, byte-exact to the ModelOpt Hugging Face export (docs/export.md, 'Numerics').

weight_scale = w_amax / 448 and input_scale = in_amax / 448, fp32 0-dim tensors (zero amax and
the scale floor: see `eprt.quant.numerics`). A quantized value is w / scale computed in fp32,
rounded first to the dtype w is held in (bf16 for a bf16 weight; a no-op for fp32), then to
E4M3 nearest-even, saturated at +-448 (the `quantize_fp8` rule).
"""

import torch

from eprt.quant.numerics import (FP8_E4M3_MAX, as_scale, check_finite, chunk_buffer, for_chunks, per_tensor_scale,
                                 row_chunks, to_e4m3)


def fp8_scale(amax) -> torch.Tensor:
    """FP8 per-tensor scale (weight_scale, input_scale, k_scale, v_scale): fp32 0-dim amax/448.

    `amax` is a Python number or a one-element tensor; amax == 0 gives 1.0.
    """
    return per_tensor_scale(amax, FP8_E4M3_MAX, zero_amax=FP8_E4M3_MAX)


def quantize_fp8(w: torch.Tensor, scale) -> torch.Tensor:
    """float8_e4m3fn tensor of w's shape from any float w and the per-tensor `scale`.

    e4m3(round_to_dtype_of_w(fp32(w) / fp32(scale))): the quotient is rounded twice, to w's own
    dtype and then to E4M3, because that is what ModelOpt's export computes (`weight / scale` of a
    bf16 weight and an fp32 0-dim scale is a bf16 tensor by torch's type promotion, cast to
    float8_e4m3fn after). Rounding once, straight from fp32, differs by one E4M3 step in a few
    percent of the elements (double rounding on the bf16 grid), so the bytes would not match.
    """
    scale = as_scale(scale, w.device)
    out = torch.empty(w.shape, dtype=torch.float8_e4m3fn, device=w.device)
    flat, q = w.reshape(-1), out.view(-1)
    step, chunks = row_chunks(flat.numel(), 1, w.device)

    def buffers() -> tuple[torch.Tensor, torch.Tensor]:
        quotient = chunk_buffer("fp8.quotient", (step,), torch.float32, w.device)
        return quotient, quotient if w.dtype == torch.float32 else chunk_buffer("fp8.rounded", (step,), w.dtype, w.device)

    def quantize(a: int, b: int, bufs: tuple[torch.Tensor, torch.Tensor]) -> None:
        f = bufs[0][: b - a].copy_(flat[a:b])
        check_finite(torch.stack(torch.aminmax(f)), w.shape)  # the extremes: NaN propagates to them
        to_e4m3(bufs[1][: b - a].copy_(f.div_(scale)), out=q[a:b])

    for_chunks(chunks, buffers, quantize, w.device)
    return out


def dequantize_fp8(q: torch.Tensor, scale, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """q (float8_e4m3fn) times scale, computed in fp32, returned as `dtype`."""
    return (q.float() * as_scale(scale, q.device)).to(dtype)


def fake_quant_fp8(x: torch.Tensor, scale) -> torch.Tensor:
    """Quantize-dequantize, in x's dtype: the values an FP8 engine computes with."""
    return dequantize_fp8(quantize_fp8(x, scale), scale, dtype=x.dtype)
