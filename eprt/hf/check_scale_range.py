"""Scales an engine's fp32 arithmetic survives.

The engines do not use a per-tensor scale only as stored. vLLM's modelopt and compressed-tensors
methods quantize each input by dividing by its input scale (NVFP4's `input_scale_inv`, the
global scale 448 x 6 / amax), multiply the input and weight scales into the one factor the GEMM's
output is scaled by (NVFP4's `alpha = input_scale * weight_scale_2`, FP8's `scale_a * scale_b`),
and scale codes back by up to 448 (FP8) or 6 x a block scale (NVFP4); the KV cache divides keys
and values by k_scale and v_scale. All of it in fp32, in kernels built to flush subnormal numbers
to zero. So a scale can be finite and positive and still load as inf or 0: 1e-40's reciprocal is
inf in fp32. Each scale, its reciprocal and each product the engine forms must be a normal fp32
number (finite, at least 2^-126).

A compressed-tensors export stores NVFP4's per-tensor scales as their reciprocals (the global
scales); `Scale.reciprocal` says so, and the rules apply to the scale they stand for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from eprt.quant.formats import WeightFormat
from eprt.quant.formats.kv import KvCacheFormat

SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)


@dataclass(frozen=True)
class Scale:
    name: str  # the tensor
    stored: float  # finite and positive (the caller has checked)
    reciprocal: bool = False  # stored as 1/scale

    @property
    def value(self) -> np.float32:
        """The scale itself, in fp32, as the engine computes it from the stored value."""
        return _f32(1.0, "/", self.stored) if self.reciprocal else np.float32(self.stored)

    @property
    def leaf(self) -> str:
        """The scale's name within its module: `1/weight_global_scale` for one stored as its reciprocal."""
        leaf = self.name.rpartition(".")[2]
        return f"1/{leaf}" if self.reciprocal else leaf


def _f32(a, op: str, b) -> np.float32:
    with np.errstate(all="ignore"):  # inf and 0 are what the checks look for
        a, b = np.float32(a), np.float32(b)
        return a * b if op == "*" else a / b


def _normal(x: np.float32) -> bool:
    return bool(np.isfinite(x)) and abs(float(x)) >= SMALLEST_NORMAL


def _what(x: np.float32) -> str:
    return "inf" if not np.isfinite(x) else f"{float(x):g}, subnormal and flushed to zero"


def check_linear(
    module: str,
    fmt: WeightFormat,
    weight: Scale | None,
    inputs: Scale | None,
    blocks: tuple[float, float] | None,
    problems: list[str],
    grid: str | None = None,
) -> None:
    """The per-tensor scales of one Linear quantized in `fmt`: `weight` (FP8's weight_scale,
    NVFP4's weight_scale_2), `inputs` (input_scale); None for one already refused or one the
    format lacks. `blocks`: the smallest and largest block scale of a block format, when known,
    from the grid named `grid`: where the format has no per-tensor weight scale (FP8 block), the
    block scales are what the engines divide and multiply by, each held to the same rules."""
    way_out = f"calibrate again (a scale this far out comes of broken weights or inputs), or leave {module} unquantized"
    code_max = fmt.largest_code(blocks[1] if blocks else None)
    if fmt.weight_scale_leaf is None and blocks and grid:
        for value in sorted(set(blocks)):
            _check_one(Scale(grid, value), code_max, "largest weight", way_out, problems)
    input_max = fmt.largest_input
    ok_w = weight is not None and _check_one(weight, code_max, "largest weight", way_out, problems)
    ok_x = inputs is not None and _check_one(inputs, input_max, "largest input", way_out, problems)
    if ok_w and ok_x:
        alpha = _f32(weight.value, "*", inputs.value)
        if not _normal(alpha):
            problems.append(
                f"{module}: {weight.leaf} {float(weight.value):g} x {inputs.leaf} "
                f"{float(inputs.value):g}, the factor the engines scale the GEMM's output by, is "
                f"{_what(alpha)} in fp32: {way_out}"
            )
    if ok_w and blocks:
        smallest = _f32(blocks[0], "*", weight.value)
        if not _normal(smallest):
            problems.append(
                f"{weight.name}: {weight.stored:g}; times the smallest block scale {blocks[0]:g} it is "
                f"{_what(smallest)} in fp32, and those blocks load as zeros: {way_out}"
            )


def check_kv(scale: Scale, kv: KvCacheFormat, problems: list[str]) -> None:
    """A k_scale or v_scale of KV format `kv`."""
    _check_one(
        scale,
        kv.largest,
        "largest cached value",
        f"calibrate again, or leave the KV cache unquantized (no --kv-cache {kv.name})",
        problems,
    )


def _check_one(scale: Scale, largest: float, largest_what: str, way_out: str, problems: list[str]) -> bool:
    """The stored value and its reciprocal normal in fp32, and `largest` x the scale finite: the
    engines divide by the one and multiply by the other."""
    stored = np.float32(scale.stored)
    inverse = _f32(1.0, "/", stored)
    if not _normal(stored):
        problems.append(
            f"{scale.name}: {scale.stored:g} is subnormal in fp32 (below {SMALLEST_NORMAL:.4g}): kernels "
            f"flush it to zero, and its reciprocal is {float(inverse):g}: {way_out}"
        )
        return False
    if not _normal(inverse):
        problems.append(
            f"{scale.name}: {scale.stored:g}; the engines also use its reciprocal, which is "
            f"{_what(inverse)} in fp32: {way_out}"
        )
        return False
    top = _f32(largest, "*", scale.value)
    if not np.isfinite(top):
        problems.append(
            f"{scale.name}: {scale.stored:g}; the {largest_what} it stands for, {largest:g} x "
            f"{scale.leaf}, is inf in fp32: {way_out}"
        )
        return False
    return True


def scalar_scale(name: str, t, problems: list[str]) -> Scale | None:
    """A per-tensor scale: 0-dim fp32, finite and positive (engines divide by it and invert it);
    None, said in problems, when it is not."""
    if t.dtype != "F32" or t.shape != ():
        problems.append(f"{name}: {t.dtype} {list(t.shape)}, expected a 0-dim F32 scale")
    elif not (math.isfinite(t.value) and t.value > 0):
        problems.append(f"{name}: {t.value}, a scale must be finite and positive")
    else:
        return Scale(name, t.value)
    return None
