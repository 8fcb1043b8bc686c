"""Rules shared by the FP8 and NVFP4 formats (docs/export.md, 'Numerics'): per-tensor scales and E4M3 rounding.

Per-tensor scale = amax / max_value, fp32 0-dim. Zero amax (an all-zero weight, an input no
calibration token reached) is replaced by the quantizer's largest representable value, as
ModelOpt's export does (`export_amax` sets a zero amax to `maxbound`): FP8 gets scale 448/448 = 1.0,
NVFP4 6/(6*448) = 1/448. Every scale is floored at the smallest normal fp32, so the scale is
never zero and an engine's reciprocal 1/scale stays finite. A negative, NaN or infinite amax is a
calibration fault and is refused.

Everything here is elementwise or a reduction in fp32, so the result is the same on every device.
"""

import math
import threading
from typing import Callable

import torch

from eprt.kernels.cpu_workers import for_each, worker_count

FP8_E4M3_MAX = 448.0
FP32_TINY = torch.finfo(torch.float32).tiny
# On CPU each elementwise step over a whole weight would write a fresh full-size temporary, and
# touching its new pages costs more than the arithmetic: the quantizers walk a weight a chunk of
# rows at a time through buffers they reuse. Elsewhere the caching allocator reuses memory and
# kernel launches cost more, so a chunk is the whole weight. One thread alone runs fastest on
# chunks its L2 cache holds (256K elements), but the workers side by side wait on each other at
# every operation (Python's lock), so fewer, larger operations win there: with 1M-element chunks
# 2 workers export bench/modelopt_baseline.py's model in 1.76 s, with 256K in 1.85 s (4 runs each, alternated).
CHUNK_ELEMENTS = 1 << 20
MIN_SHARED_ELEMENTS = 1 << 15  # the least a chunk holds that goes to a worker of its own


def per_tensor_scale(amax, max_value: float, zero_amax: float) -> torch.Tensor:
    """amax / max_value as an fp32 0-dim CPU tensor; a zero amax counts as `zero_amax`.

    Raises ValueError for an amax that is not one finite, non-negative number.
    """
    amax = torch.as_tensor(amax).detach().to(device="cpu", dtype=torch.float32)
    if amax.numel() != 1:
        raise ValueError(f"amax must be one number (per-tensor scale), got shape {tuple(amax.shape)}")
    amax = amax.reshape(())
    value = amax.item()
    if not (0.0 <= value < float("inf")):
        raise ValueError(
            f"amax is {value}: a per-tensor scale needs a finite, non-negative amax; "
            "a NaN or infinite amax means the calibrated tensor held non-finite values"
        )
    if value == 0.0:
        amax = torch.tensor(zero_amax, dtype=torch.float32)
    return (amax / max_value).clamp(min=FP32_TINY)


def as_scale(scale, device) -> torch.Tensor:
    """A per-tensor scale (number or one-element tensor) as an fp32 0-dim tensor on `device`."""
    scale = torch.as_tensor(scale).to(device=device, dtype=torch.float32)
    if scale.numel() != 1:
        raise ValueError(f"a per-tensor scale is one number, got shape {tuple(scale.shape)}")
    return scale.reshape(())


# Every float8_e4m3fn value by its byte: decoding by lookup is several times faster on CPU than
# torch's own cast, which converts element by element.
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def e4m3_values(x: torch.Tensor) -> torch.Tensor:
    """fp32 values of float8_e4m3fn x (the same as x.float())."""
    index = x.contiguous().view(torch.uint8).reshape(-1).to(torch.int32)
    return _E4M3_VALUES.to(x.device).index_select(0, index).view(x.shape)


def row_chunks(rows: int, row_len: int, device: torch.device) -> tuple[int, list[tuple[int, int]]]:
    """(rows a chunk holds at most, the chunks [a, b) of `rows` rows of `row_len` elements)."""
    # no more rows than there are: the buffers a chunk is given are sized by it
    step = max(1, min(rows, CHUNK_ELEMENTS // max(1, row_len))) if device.type == "cpu" else max(1, rows)
    workers = worker_count(device)
    if workers > 1:  # a few chunks a worker, so that none waits long for the last, none so small
        # that handing it to a worker costs more than its work
        least = max(1, MIN_SHARED_ELEMENTS // max(1, row_len))
        step = max(1, min(step, max(least, -(-rows // (4 * workers)))))
    return step, [(a, min(a + step, rows)) for a in range(0, rows, step)]


_kept = threading.local()  # each thread's chunk buffers, by slot and dtype


def chunk_buffer(slot: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized buffer of `shape` for the chunks of `for_chunks`: on CPU the calling
    thread's own under `slot`, kept from call to call (fresh pages cost more than the arithmetic
    on them; a chunk bounds its size), elsewhere a new one (the caching allocator reuses memory).
    One call's buffers of a slot are the next call's on that thread: use them within the call."""
    if device.type != "cpu":
        return torch.empty(shape, dtype=dtype, device=device)
    n = math.prod(shape)
    kept = _kept.__dict__.get((slot, dtype))
    if kept is None or kept.numel() < n:
        with torch.inference_mode(False):  # a normal tensor, written inside inference mode and out of it
            kept = _kept.__dict__[(slot, dtype)] = torch.empty(n, dtype=dtype)
    return kept[:n].view(shape)


def for_chunks(
    chunks: list[tuple[int, int]],
    buffers: Callable[[], object],
    body: Callable[[int, int, object], None],
    device: torch.device,
) -> None:
    """body(a, b, bufs) for every chunk [a, b), with `bufs` from buffers() reused from chunk to
    chunk: in order, or on the workers of eprt.kernels.cpu_workers, each with buffers of its own."""
    for_each(chunks, buffers, lambda ab, bufs: body(*ab, bufs), device)


def abs_amax(x: torch.Tensor) -> torch.Tensor:
    """fp32 0-dim largest magnitude of x (NaN if x holds one): one pass, without an |x| copy."""
    lo, hi = torch.aminmax(x)
    # abs: of -0.0 and 0.0 maximum may keep either, and |x|'s max is +0.0 where x is all zeros
    return torch.maximum(hi, -lo).abs().float()


def check_finite(values: torch.Tensor, shape) -> None:
    """Refuse NaN and infinity in a tensor of `shape` (`values`: the tensor, or a max over it):
    rounding would turn them into plausible-looking codes."""
    if not torch.isfinite(values).all():
        raise ValueError(f"tensor of shape {tuple(shape)} holds NaN or infinite values; refusing to quantize it")


def to_e4m3(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Round to float8_e4m3fn, nearest-even, saturating at +-448; with `out` (float8_e4m3fn, x's
    shape), into it, clamping x in place (a buffer of the caller's: no temporary).

    The clamp comes first because torch's own cast saturates in some versions and on some devices
    and gives NaN beyond 448 in others; clamped, the cast only rounds.
    """
    # Clamped in x's own dtype where +-448 is exact (no fp32 copy of a bf16 weight): the clamp
    # changes no value and the cast rounds the same (every bf16 and fp16 value checked).
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    if out is None:
        return x.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return out.copy_(x.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX))
