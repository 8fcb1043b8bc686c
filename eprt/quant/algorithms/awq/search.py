"""AWQ's search numerics (eprt.quant.algorithms.awq.passes runs them): the candidate scales of a balance
group, and each candidate's quantized output error on one canonical unit of calibration rows.

The candidates follow the published method: for alpha on a grid of 20 in [0, 1), s =
mean|x|^alpha (mean |x| each input channel's over the group's calibration rows), divided by
sqrt(max(s) min(s)); the identity (alpha 0, max's rounding) is always a candidate, so the search
never chooses worse than no scale by its own measure. (Dividing by the weights' mean magnitude
as well, "duo" scaling, did worse on the trained bench model: docs/quality.md.)

A candidate is scored by the error of what the group's readers compute, quantized as the export
quantizes them (weights folded and fake-quantized, inputs x / s through the format's input
quantization under the input scale the scaled amax gives), against their original output. A
gated MLP's gate and up (a routed expert's first projection, a dense or shared MLP's gate_proj and up_proj) are
scored on the MLP's output, through its activation and its original down projection: an error in
gate or up weighs what it changes downstream, not its own magnitude."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from eprt.parallel import ParallelState
from eprt.quant.algorithms.awq.folds import fold
from eprt.quant.algorithms.gptq.solve import FIXED_POINT_BITS
from eprt.quant.formats import WeightFormat
from eprt.quant.formats.base import ScaledByBlocks
from eprt.quant.numerics import abs_amax

STEPS = 20  # alpha, the exponent of mean |x|, is k / STEPS for k in 0 .. STEPS - 1 (k 0: the identity)
# The search tries these k first, then k +- 2 and k +- 1 around the best so far: 9 candidates of
# the 20, the best of them the grid's best wherever the loss falls and rises once along alpha.
COARSE = (0, 4, 8, 12, 16)
REFINE = (2, 1)
SUM_SHIFT = 20  # a unit's fp64 sum of |x| is rounded to a multiple of 2^-20, then summed exactly in int64
SMALLEST_MEAN = 1e-4  # a channel's mean |x| below it counts as it: a dead channel gets no infinite scale
# The search scores a canonical unit on about this many of its rows, evenly spaced (the statistics
# take them all): each candidate costs a matmul of them per reader, and more rows changed the
# chosen alphas of the trained bench model (bench/quality.py) little beyond it.
SCORED_ROWS = 64
# The candidates' quantized inputs are made for many units at once (one call of the format's
# input quantization per candidate, not per unit): at most about this many elements at a time.
BATCH_ELEMENTS = 1 << 24


def scored(x: torch.Tensor) -> torch.Tensor:
    """The rows of one unit's [n, C] that the search scores: every k-th, at most about SCORED_ROWS."""
    return x[:: max(1, x.shape[0] // SCORED_ROWS)]


def channel_sums(x: torch.Tensor) -> torch.Tensor:
    """Per-channel sums of |x| over dim -2 of [..., n, C] in int64 fixed point (exact to sum in any order)."""
    return torch.round(x.abs().double().sum(-2) * 2.0**SUM_SHIFT).to(torch.int64)


def candidates(x_mean: torch.Tensor, ks: torch.Tensor) -> torch.Tensor:
    """The scales of alphas ks / STEPS (ks [A] int64, or [A, L]: each of L rows its own) from the
    per-channel mean |x| [..., C] ([L, C] with rows): fp32 [A, ..., C], s = x^alpha divided by the
    square root of its largest times its smallest; k 0 gives ones, the identity."""
    x = x_mean.clamp(min=SMALLEST_MEAN)
    alpha = (ks.double() / STEPS).reshape(*ks.shape, *[1] * (x.dim() - ks.dim() + 1)).to(x.device)
    s = x.pow(alpha)
    s = s / (s.amax(-1, keepdim=True) * s.amin(-1, keepdim=True)).sqrt()
    return torch.where(alpha == 0, torch.ones_like(s), s).float()


def search(losses_of: Callable[[torch.Tensor], torch.Tensor], rows: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The best k of each of `rows` rows, coarse to fine: `losses_of(ks [A, rows])` gives their
    losses [rows, A] (the same on every rank). Returns (best k [rows] int64, (its loss, the
    identity's) [rows, 2] fp64); of equal losses the first tried wins, the identity first of all."""
    ks = torch.tensor(COARSE, device=device)[:, None].expand(-1, rows)
    losses = losses_of(ks)
    pick = losses.argmin(1)
    best, loss, identity = (
        ks[pick, torch.arange(rows, device=device)],
        losses.gather(1, pick[:, None])[:, 0],
        losses[:, 0],
    )
    for step in REFINE:
        ks = torch.stack([(best - step).clamp(min=0), (best + step).clamp(max=STEPS - 1)])
        losses = losses_of(ks)
        pick = losses.argmin(1)
        better = losses.gather(1, pick[:, None])[:, 0] < loss
        best = torch.where(better, ks[pick, torch.arange(rows, device=device)], best)
        loss = torch.where(better, losses.gather(1, pick[:, None])[:, 0], loss)
    return best, torch.stack([loss, identity], 1)


def candidates_at_once(fmt: WeightFormat) -> bool:
    """Whether `fake_weights` quantizes every candidate of `fmt` in one call: a format with no
    per-tensor scale whose rows quantize apart gives each candidate's rows the values they get
    alone, for one call's fixed cost."""
    return isinstance(fmt, ScaledByBlocks) and not fmt.blocks_span_rows


def fake_weights(
    fmt: WeightFormat, w: torch.Tensor, kind: str, scales: torch.Tensor, out: torch.Tensor | None = None
) -> torch.Tensor:
    """w [out, in] folded with each candidate of `scales` [A, C] as `kind` folds it, quantized and
    dequantized as max rounds it (its own per-tensor scale): fp32 [A, in, out], transposed for the
    matmul, written into `out` where given (one candidate's temporaries at a time, every
    candidate's at once for a format with no per-tensor scale whose rows quantize apart)."""
    out = torch.empty(scales.shape[0], w.shape[-1], w.shape[-2], device=w.device) if out is None else out
    if candidates_at_once(fmt):
        q = torch.stack([fold([(kind, s)], w) for s in scales])
        out.copy_(fmt.fake_quantize_weight(q, fmt.scale(abs_amax(q)), False, torch.float32).transpose(-1, -2))
        return out
    for a, s in enumerate(scales):
        q = fold([(kind, s)], w)
        out[a] = fmt.fake_quantize_weight(q, fmt.scale(abs_amax(q)), False, torch.float32).T
    return out


def fake_inputs(fmt: WeightFormat, x: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x [n, C] / each candidate of `scales` [A, C] as the format quantizes a reader's input, under
    the input scale of the scaled amax: [A, n, C] in x's dtype. The quantization is row by row, so
    rows of many units quantized together are each what they would be alone."""
    out = torch.empty(scales.shape[0], *x.shape, dtype=x.dtype, device=x.device)
    for a, s in enumerate(scales):
        out[a] = fmt.fake_quantize_input((x.float() / s).to(x.dtype), fmt.scale((amax / s).max()))
    return out


@dataclass
class Reader:
    """One term of a group's loss: a reader (or a gated MLP's gate and up) with its candidates."""

    fmt: WeightFormat
    w: torch.Tensor  # the original weight [out, C], fp32; a gated MLP's gate rows, then its up rows
    quantized: torch.Tensor  # its candidates fake-quantized, fp32 [A, C, out]
    down: torch.Tensor | None = None  # a gated MLP's down [D, I], fp32: the error is the MLP's output's
    act: Callable | None = None

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        """What the candidates' outputs on rows x [n, C] are compared with, fp32: the original
        reader's output, a gated MLP's activation."""
        ref = x.float() @ self.w.T
        if self.down is None:
            return ref
        width = ref.shape[-1] // 2
        return self.act(ref[:, :width], ref[:, width:])

    def errors(self, x: torch.Tensor, x_q: torch.Tensor, ref: torch.Tensor | None = None) -> torch.Tensor:
        """Each candidate's sum of squared output errors [A] fp64 on rows x [n, C], whose
        quantized candidates are x_q [A, n, C]; `ref`: `reference(x)`, where the caller keeps it."""
        ref = self.reference(x) if ref is None else ref
        out = torch.bmm(x_q.float().contiguous(), self.quantized)
        if self.down is not None:
            width = out.shape[-1] // 2
            out = (self.act(out[..., :width], out[..., width:]) - ref) @ self.down.T
        else:
            out -= ref
        return out.pow_(2).sum((1, 2), dtype=torch.float64)


def kept_reference(reader: Reader, x: torch.Tensor, refs: list | None, i: int) -> torch.Tensor | None:
    """`reader.reference(x)` of unit i, made once and kept in `refs` (a list the caller holds
    through the search's rounds, None for each unit not yet seen); None where no list is given."""
    if refs is None:
        return None
    if refs[i] is None:
        refs[i] = reader.reference(x)
    return refs[i]


def batches(units: list[torch.Tensor], candidates: int) -> Iterator[tuple[int, int]]:
    """[start, end) of `units` whose rows' quantized candidates make about BATCH_ELEMENTS elements
    (at least one unit each)."""
    start = 0
    while start < len(units):
        end, elements = start, 0
        while end < len(units) and (end == start or elements < BATCH_ELEMENTS):
            elements += units[end].numel() * candidates
            end += 1
        yield start, end
        start = end


def unit_errors(
    reader: Reader,
    units: list[torch.Tensor],
    scales: torch.Tensor,
    amax: torch.Tensor,
    kept: dict | None = None,
    refs: list | None = None,
) -> list[torch.Tensor]:
    """`reader`'s candidates' errors [A] fp64 on each unit's scored rows [n, C] of `units`, their
    quantized candidates made in batches; where they fit in one, `kept` (a dict the caller holds)
    keeps them by format for the next reader of the same units; `refs` keeps the units' references
    (`kept_reference`) from round to round."""
    out: list[torch.Tensor] = []
    one = len(list(batches(units, scales.shape[0]))) == 1
    for start, end in batches(units, scales.shape[0]):
        if one and kept is not None and reader.fmt in kept:
            quantized = kept[reader.fmt]
        else:
            quantized = fake_inputs(reader.fmt, torch.cat(units[start:end]), scales, amax)
            if one and kept is not None:
                kept[reader.fmt] = quantized
        first = 0
        for i, x in enumerate(units[start:end], start):
            out.append(reader.errors(x, quantized[:, first : first + x.shape[0]], kept_reference(reader, x, refs, i)))
            first += x.shape[0]
    return out


def readers_errors(
    readers: list[tuple[Callable[[], Reader], list[torch.Tensor]]],
    fmt: WeightFormat,
    scales: torch.Tensor,
    amax: torch.Tensor,
    refs: list[list] | None = None,
) -> list[torch.Tensor]:
    """The errors [A] fp64 of each unit of many readers of one input in one format (the routed
    experts' gate/up: each (its reader made on demand, its units' scored rows)), in order: the
    rows' quantized candidates made for every reader's units together, one reader's candidate
    weights held at a time; `refs` (a list per reader) keeps the units' references from round to
    round."""
    flat = [(i, j, x) for i, (_, units) in enumerate(readers) for j, x in enumerate(units)]
    out: list[torch.Tensor] = []
    current, reader = -1, None
    for start, end in batches([x for _, _, x in flat], scales.shape[0]):
        quantized = fake_inputs(fmt, torch.cat([x for _, _, x in flat[start:end]]), scales, amax)
        first = 0
        for i, j, x in flat[start:end]:
            if i != current:
                reader = None  # the last reader's candidates go before the next one's are made
                current, reader = i, readers[i][0]()
            ref = kept_reference(reader, x, None if refs is None else refs[i], j)
            out.append(reader.errors(x, quantized[:, first : first + x.shape[0]], ref))
            first += x.shape[0]
    return out


def exact_totals(state: ParallelState, errors: torch.Tensor, units: int, over: str) -> torch.Tensor:
    """Sums over dim 0 of `errors` [n, ...] (fp64, one row a canonical unit of this rank), over the
    ranks of `over`, the same fp64 bits at every layout: each unit's error rounded once to a
    multiple of 2^-shift (the shift from the largest error of any rank and `units`, the most units
    a total holds), summed exactly in int64, then scaled back."""
    largest = errors.max() if errors.numel() else torch.zeros((), dtype=torch.float64, device=errors.device)
    largest = state.all_reduce(largest.clone(), over="dp", op=dist.ReduceOp.MAX)
    bound = float(largest) * max(units, 1)
    shift = FIXED_POINT_BITS - math.frexp(bound)[1] if bound > 0 and math.isfinite(bound) else 0
    totals = torch.round(errors * 2.0**shift).to(torch.int64).sum(0)
    return state.all_reduce(totals, over=over, op=dist.ReduceOp.SUM).double() * 2.0**-shift
