"""FP8 E4M3 per-tensor quantization, byte-exact to the ModelOpt Hugging Face export (docs/export.md, 'Numerics').

weight_scale = w_amax / 448 and input_scale = in_amax / 448, fp32 0-dim tensors (zero amax and
the scale floor: see `eprt.quant.numerics`). A quantized value is w / scale computed in fp32,
rounded first to the dtype w is held in (bf16 for a bf16 weight; a no-op for fp32), then to
E4M3 nearest-even, saturated at +-448 (the `quantize_fp8` rule). Under `mse` the weight scale is
searched (`fp8_mse_scale`).
"""

import math

import torch

from eprt.quant.formats.base import CT_SCALAR, Tensors, WeightFormat
from eprt.quant.numerics import (
    CHUNK_ELEMENTS,
    FP8_E4M3_MAX,
    as_scale,
    check_finite,
    chunk_buffer,
    for_chunks,
    per_tensor_scale,
    row_chunks,
    to_e4m3,
)


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
        rounded = quotient if w.dtype == torch.float32 else chunk_buffer("fp8.rounded", (step,), w.dtype, w.device)
        return quotient, rounded

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


# ModelOpt's MseCalibrator defaults: start 0.25, stop 4.0, step 0.1 -> ceil(37.5) + 1 = 39 candidates.
MSE_MULTIPLIERS = torch.cat([torch.ones(1), torch.linspace(0.25, 4.0, steps=math.ceil((4.0 - 0.25) / 0.1) + 1)])


def fp8_mse_scale(w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """The FP8 weight_scale of least squared error for w (as quantize_fp8 takes it) among
    fp8_scale(amax * c), c in MSE_MULTIPLIERS (ModelOpt's `MseCalibrator`: 0.25 to 4.0, 39
    steps, with 1.0, max's own candidate, first: a tie keeps the first, so mse's error is never
    above max's). Errors are summed in float64; `amax`: w's abs-max (fp32)."""
    x = w.double()
    best, best_err = None, math.inf
    for c in MSE_MULTIPLIERS:
        scale = fp8_scale(amax * c)
        err = (x - dequantize_fp8(quantize_fp8(w, scale), scale).double()).square_().sum().item()
        if err < best_err:
            best, best_err = scale, err
    return best


class Fp8Columns:
    """GPTQ's columns in FP8 per tensor, for a stack of weights [L, out, in]: `scales` [L] (each
    the export's weight_scale, from its original weight); a column is rounded to nearest E4M3
    once, from its fp32 quotient."""

    def __init__(self, scales: torch.Tensor):
        self.scales = scales.float()

    def round(self, j: int | torch.Tensor, col_LO: torch.Tensor) -> torch.Tensor:
        s = self.scales.to(col_LO.device)[:, None]
        return to_e4m3(col_LO.float() / s).float() * s  # `dequantize_fp8`'s product

    def encode(self, q: torch.Tensor) -> torch.Tensor:
        """float8_e4m3fn codes [L, out, in] of GPTQ's (exactly representable) weights."""
        return to_e4m3(q.float() / self.scales.to(q.device)[:, None, None])

    def decode(self, codes: torch.Tensor) -> torch.Tensor:
        return torch.stack([dequantize_fp8(c, s) for c, s in zip(codes, self.scales)])


class Fp8(WeightFormat):
    """FP8 E4M3 weights with one fp32 scale per tensor, inputs with a static per-tensor scale."""

    name = "fp8"
    quant_algo = "FP8"
    num_bits = 8
    rounds_in_weight_dtype = True
    weight_scale_leaf = "weight_scale"
    ct_preset, ct_format = "FP8", "float-quantized"
    ct_strategy = "tensor"
    ct_weight_scale_leaf, ct_input_scale_leaf = "weight_scale", "input_scale"
    largest_input = FP8_E4M3_MAX
    export_working_bytes = 1  # the codes
    # each thread's chunk buffers: the fp32 quotient (4) and its rounding to a bf16 weight's dtype (2)
    export_worker_bytes = (4 + 2) * CHUNK_ELEMENTS

    def scale(self, amax) -> torch.Tensor:
        return fp8_scale(amax)

    def mse_weight_scale(self, w: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        return fp8_mse_scale(w, amax)

    def quantize(self, w: torch.Tensor, w_scale: torch.Tensor, mse: bool) -> dict[str, torch.Tensor]:
        return {"weight": quantize_fp8(w, w_scale), "weight_scale": w_scale}

    def dequantize(self, t: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize_fp8(t["weight"], t["weight_scale"], dtype)

    def fake_quantize_input(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quant_fp8(x, scale)

    def columns(self, w: torch.Tensor, scales: torch.Tensor) -> Fp8Columns:
        return Fp8Columns(scales)

    def modelopt_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {
            "weight": (torch.float8_e4m3fn, (out_dim, in_dim)),
            "weight_scale": (torch.float32, ()),
            "input_scale": (torch.float32, ()),
        }

    def compressed_tensors_tensors(self, out_dim: int, in_dim: int) -> Tensors:
        return {
            "weight": (torch.float8_e4m3fn, (out_dim, in_dim)),
            "weight_scale": (torch.float32, CT_SCALAR),
            "input_scale": (torch.float32, CT_SCALAR),
        }

    def to_compressed_tensors(self, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {
            "weight": t["weight"],
            "weight_scale": t["weight_scale"].reshape(CT_SCALAR),
            "input_scale": t["input_scale"].reshape(CT_SCALAR),
        }

    def largest_code(self, largest_block: float | None) -> float:
        return FP8_E4M3_MAX


FP8 = Fp8()
