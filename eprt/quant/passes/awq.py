"""AWQ (Lin et al., 2023) as a pass: per-channel scales for each balance group of a layer
(eprt.quant.awq_groups: what makes a tensor and the Linears that read it), searched on the group's
own calibration inputs and folded into the weights (eprt.quant.awq_folds).

For each layer:
1. on the statistics run, each group's tensor is kept as its first reader reads it, one canonical
   unit at a time: a dense reader's input per call (one sequence), the routed experts' inputs and
   activations per (expert, work unit);
2. in `reference`, from those samples: each group's per-channel mean |x| (each unit's fp64 sum
   rounded to int64 fixed point, summed exactly over the ranks) and amax; the candidates
   s = mean^alpha for alpha in GRID, each divided by sqrt(max(s) * min(s)) (alpha 0 is the
   identity, max's weights); each scored by the group's quantized output error: every quantized
   reader's output from its weight scaled by s, quantized with its format's own fake quantization
   (its input x / s too, under the input scale the candidate gives), against its original output,
   a sum of squares per unit turned into int64 fixed point (a power-of-two scale from the largest
   unit's error over the ranks) and summed over the ranks exactly, so every rank chooses the same
   alpha at every layout (the routed experts' activations: each expert its own alpha);
3. the fold of each group's best candidate, read back into the layer through the folded
   checkpoint, as the export reads it;
4. a run of the calibration sequences through the folded layer measures its amax again (the
   readers' inputs are now x / s, every later module's move by the folds' roundings) and the routed
   token counts (a bf16 router's choices may move with its rounding), in place of the statistics
   run's, and makes the calibration sequences' output unless GPTQ's quantized run makes it.

The samples are the layer's inputs to its groups, held until the search is done (about the hidden
states once per group, and the routed rows once); the statistics run only observes. The multi-token-prediction layers are left as they are.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist

from eprt.models.moe import Experts
from eprt.models.resolved import place_tensors
from eprt.models.taps import tapped
from eprt.parallel import ParallelState
from eprt.progress import logger
from eprt.quant.awq_folds import COLUMNS, W2_COLUMNS, W13_COLUMNS, Folds, fold
from eprt.quant.awq_groups import Group, layer_groups
from eprt.quant.calibrate import CalibrationError, Calibrator
from eprt.quant.engine import LayerWork, Pass
from eprt.quant.formats import WeightFormat, weight_format
from eprt.quant.gptq import FIXED_POINT_BITS
from eprt.quant.numerics import abs_amax
from eprt.quant.recipe import Recipe

GRID = tuple(i / 20 for i in range(20))  # alpha, the exponent of mean |x|
SUM_SHIFT = 20  # a unit's fp64 sum of |x| is rounded to a multiple of 2^-20, then summed exactly in int64
SMALLEST_MEAN = 1e-4  # a channel's mean |x| below it counts as it: a dead channel gets no infinite scale
# The search scores a canonical unit on about this many of its rows, evenly spaced (the statistics
# take them all): each candidate costs a matmul of them per reader, and more rows changed the
# chosen alphas of the trained bench model (bench/quality.py) little beyond it.
SCORED_ROWS = 64


def scored(x: torch.Tensor) -> torch.Tensor:
    """The rows of one unit's [n, C] that the search scores: every k-th, at most about SCORED_ROWS."""
    return x[:: max(1, x.shape[0] // SCORED_ROWS)]


def channel_sums(x: torch.Tensor) -> torch.Tensor:
    """One unit's per-channel sum of |x| [..., C] in int64 fixed point (exact to sum in any order)."""
    return torch.round(x.abs().double().sum(0) * 2.0**SUM_SHIFT).to(torch.int64)


def candidates(mean: torch.Tensor) -> torch.Tensor:
    """The scales of every alpha of GRID from the per-channel mean |x| [..., C]: fp32 [A, ..., C],
    each row divided by the square root of its largest times its smallest; alpha 0 gives ones."""
    m = mean.clamp(min=SMALLEST_MEAN)
    out = []
    for alpha in GRID:
        s = m.pow(alpha)
        out.append(s / (s.amax(-1, keepdim=True) * s.amin(-1, keepdim=True)).sqrt())
    return torch.stack(out).float()


def fake_weights(fmt: WeightFormat, w: torch.Tensor, kind: str, scales: torch.Tensor) -> torch.Tensor:
    """w folded with each candidate of `scales` [A, C] as `kind` folds it, quantized and dequantized as
    max rounds it (its own per-tensor scale): fp32 [A, in, out], transposed for the matmul."""
    out = []
    for s in scales:
        q = fold([(kind, s)], w)
        out.append(fmt.fake_quantize_weight(q, fmt.scale(abs_amax(q)), False, torch.float32).T)
    return torch.stack(out)


def fake_inputs(fmt: WeightFormat, x: torch.Tensor, scales: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
    """x [n, C] / each candidate of `scales` [A, C] as the format quantizes a reader's input, under
    the input scale of the scaled amax: [A, n, C] in x's dtype."""
    return torch.stack(
        [fmt.fake_quantize_input((x.float() / s).to(x.dtype), fmt.scale((amax / s).max())) for s in scales]
    )


def squared_errors(x_q: torch.Tensor, w_q: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Each candidate's sum of squared differences [A] fp64 between the quantized output x_q [A, n, C]
    @ w_q [A, C, out] and the original x [n, C] @ w [out, C]."""
    ref = x.float() @ w.float().T
    return (torch.bmm(x_q.float(), w_q) - ref).pow_(2).sum((1, 2), dtype=torch.float64)


def exact_totals(state: ParallelState, errors: torch.Tensor, units: int, over: str) -> torch.Tensor:
    """Sums over dim 0 of `errors` [n, ...] (fp64, one row a canonical unit of this rank), over the
    ranks of `over`, the same int64 bits at every layout: each unit's error rounded once to a
    multiple of 2^-shift, the shift from the largest error of any rank and `units`, the most units
    a total holds."""
    largest = errors.max() if errors.numel() else torch.zeros((), dtype=torch.float64, device=errors.device)
    largest = state.all_reduce(largest.clone(), over="dp", op=dist.ReduceOp.MAX)
    bound = float(largest) * max(units, 1)
    shift = FIXED_POINT_BITS - math.frexp(bound)[1] if bound > 0 and math.isfinite(bound) else 0
    totals = torch.round(errors * 2.0**shift).to(torch.int64).sum(0)
    return state.all_reduce(totals, over=over, op=dist.ReduceOp.SUM)


class ExpertSamples:
    """The routed rows of one experts module by (local expert, work unit): inputs and activations."""

    def __init__(self, experts: Experts):
        self.x: list[list[torch.Tensor]] = [[] for _ in range(experts.count)]
        self.h: list[list[torch.Tensor]] = [[] for _ in range(experts.count)]

    def add(self, x_sorted: torch.Tensor, h_sorted: torch.Tensor, rows_per_unit_LU: torch.Tensor) -> None:
        start = 0
        for l, row in enumerate(rows_per_unit_LU.tolist()):
            for n in row:
                if n:
                    self.x[l].append(x_sorted[start : start + n].detach())
                    self.h[l].append(h_sorted[start : start + n].detach())
                    start += n


class AWQ(Pass):
    rewrites = True
    covers_mtp = False
    calibration_runs = 1  # the folded layer's statistics

    def __init__(self, cal: Calibrator, recipe: Recipe, folds: Folds, *, writes: bool):
        """`folds`: the run's, which its checkpoint is read through; `writes`: the folded layer's run
        makes the calibration sequences' output (no GPTQ after it)."""
        self.cal, self.recipe, self.folds, self.writes = cal, recipe, folds, writes
        self.targets = set(cal.targets)
        # the running layer's, from `observe` to `reference`
        self.groups: list[Group] = []
        self.dense: dict[str, list[torch.Tensor]] = {}  # a group's first reader -> its inputs, one a call
        self.experts: dict[str, ExpertSamples] = {}

    def _balanced(self, layer: LayerWork) -> list[Group]:
        groups, left_out = layer_groups(layer.module, layer.prefix)
        out = []
        for g in groups:
            scored = [m for m, _ in g.readers if m in self.targets]
            if scored and all(self.recipe.balanced(m) for m in scored):
                out.append(g)
            elif any(self.recipe.balanced(m) for m in scored):
                left_out.append(f"{g.readers[0][0]}'s input ({g.what}): its other readers' rules are not AWQ")
        if layer.state.rank == 0:
            for what in left_out:
                logger().info("AWQ leaves out %s", what)
        return out

    def _sub(self, layer: LayerWork, name: str):
        return layer.module.get_submodule(name[len(layer.prefix) :])

    @contextlib.contextmanager
    def observe(self, layer: LayerWork) -> Iterator[None]:
        self.groups = self._balanced(layer)
        with contextlib.ExitStack() as taps:
            for g in self.groups:
                first = g.readers[0][0]
                module = self._sub(layer, first)
                if not isinstance(module, Experts):
                    self.dense[first] = inputs = []
                    hook = lambda _m, args, inputs=inputs: inputs.append(args[0].detach())  # noqa: E731
                    taps.callback(module.register_forward_pre_hook(hook).remove)
                for m, _ in g.readers:
                    experts = self._sub(layer, m)
                    if isinstance(experts, Experts) and m in self.targets and m not in self.experts:
                        self.experts[m] = samples = ExpertSamples(experts)
                        taps.enter_context(tapped(experts, units=samples.add))
            yield

    def reference(self, layer: LayerWork) -> None:
        groups, self.groups = self.groups, []
        if groups:
            with torch.no_grad():
                changed = [n for g in groups for n in self._balance(layer, g)]
            self.dense, self.experts = {}, {}
            place_tensors(
                layer.engine.rc, layer.module, sorted(set(changed)), device=layer.state.device, prefix=layer.prefix
            )
            self._measure_again(layer)
        elif self.writes:
            layer.run_calibration(write=True)

    # --- the search ---------------------------------------------------------------------------
    def _balance(self, layer: LayerWork, g: Group) -> list[str]:
        """Search group g's scales and fold the best in; returns the tensors the fold changes."""
        if g.per_expert:
            return self._balance_experts(layer, g)
        st = layer.state
        inputs = self.dense[g.readers[0][0]]
        dim = self._sub(layer, g.readers[0][0]).weight.shape[1]
        device = self._sub(layer, g.readers[0][0]).weight.device
        sums = sum(
            (channel_sums(x.reshape(-1, dim)) for x in inputs), torch.zeros(dim, dtype=torch.int64, device=device)
        )
        tokens = torch.tensor(sum(x.numel() // dim for x in inputs), dtype=torch.int64, device=device)
        amax = torch.zeros(dim, dtype=torch.float32, device=device)
        for x in inputs:
            torch.maximum(amax, x.reshape(-1, dim).abs().amax(0).float(), out=amax)
        st.all_reduce(sums, over="dp", op=dist.ReduceOp.SUM)
        st.all_reduce(tokens, over="dp", op=dist.ReduceOp.SUM)
        st.all_reduce(amax, over="dp", op=dist.ReduceOp.MAX)
        if not torch.isfinite(amax).all():
            raise CalibrationError(f"AWQ: {g.readers[0][0]}'s input holds NaN or infinity")
        mean = sums.double() / 2.0**SUM_SHIFT / max(int(tokens), 1)
        if g.repeat is None:
            divided = scales = candidates(mean)  # [A, D]
        else:  # v's channel: the mean over the query heads that read it; o's scale: v's repeated
            heads, head_dim = g.repeat
            divided = candidates(mean.view(-1, heads, head_dim).mean(1).reshape(-1))
            scales = g.reader_scales(divided)
        rows = []  # one per unit: each candidate's error
        readers = [
            (m, self._sub(layer, m), weight_format(self.recipe.format_of(m))) for m, _ in g.readers if m in self.targets
        ]
        dense = [
            (m.weight.detach(), fmt, fake_weights(fmt, m.weight.detach(), COLUMNS, scales))
            for _, m, fmt in readers
            if not isinstance(m, Experts)
        ]
        for x in inputs:
            x = scored(x.reshape(-1, dim))
            by_format = {}  # the inputs as each format quantizes them
            row = torch.zeros(len(GRID), dtype=torch.float64, device=device)
            for w, fmt, quantized in dense:
                if fmt not in by_format:
                    by_format[fmt] = fake_inputs(fmt, x, scales, amax)
                row += squared_errors(by_format[fmt], quantized, x, w)
            rows.append(row)
        units = layer.engine.calibration.schedule.num_sequences
        for name, experts, fmt in ((n, m, f) for n, m, f in readers if isinstance(m, Experts)):
            samples = self.experts[name]
            units += experts.num_experts * layer.engine.calibration.schedule.num_groups
            for l in range(experts.count):
                if samples.x[l]:
                    w = experts.w13[l].detach()
                    quantized = fake_weights(fmt, w, W13_COLUMNS, scales)
                    for x in map(scored, samples.x[l]):
                        rows.append(squared_errors(fake_inputs(fmt, x, scales, amax), quantized, x, w))
        errors = torch.stack(rows).to(device) if rows else torch.zeros(0, len(GRID), dtype=torch.float64, device=device)
        losses = exact_totals(st, errors, units, "dp")
        best = int(torch.argmin(losses))  # the first of equal losses: alpha 0, the identity, wins a tie
        self._log(layer, g, GRID[best], losses[best], losses[0])
        s = scales[best].cpu()
        return [self.folds.add(*g.divided, divided[best].cpu()), *(self.folds.add(m, kind, s) for m, kind in g.readers)]

    def _balance_experts(self, layer: LayerWork, g: Group) -> list[str]:
        """The routed experts' activations: each expert's scales of its own, from its units."""
        st, name = layer.state, g.readers[0][0]
        experts: Experts = self._sub(layer, name)
        samples, fmt = self.experts[name], weight_format(self.recipe.format_of(name))
        L, I, device = experts.count, experts.w2.shape[2], experts.w2.device
        sums = torch.zeros(L, I, dtype=torch.int64, device=device)
        tokens = torch.zeros(L, dtype=torch.int64, device=device)
        amax = torch.zeros(L, I, dtype=torch.float32, device=device)
        for l, units in enumerate(samples.h):
            for h in units:
                sums[l] += channel_sums(h)
                tokens[l] += h.shape[0]
                torch.maximum(amax[l], h.abs().amax(0).float(), out=amax[l])
        st.all_reduce(sums, over="edp", op=dist.ReduceOp.SUM)
        st.all_reduce(tokens, over="edp", op=dist.ReduceOp.SUM)
        st.all_reduce(amax, over="edp", op=dist.ReduceOp.MAX)
        if not torch.isfinite(amax).all():
            raise CalibrationError(f"AWQ: {name}'s down input holds NaN or infinity")
        scales = candidates(sums.double() / 2.0**SUM_SHIFT / tokens.clamp(min=1)[:, None])  # [A, L, I]
        rows = []  # one per unit: [L, A], the unit's expert's row filled
        for l, units in enumerate(samples.h):
            if units:
                w = experts.w2[l].detach()
                quantized = fake_weights(fmt, w, W2_COLUMNS, scales[:, l])
                for h in map(scored, units):
                    row = torch.zeros(L, len(GRID), dtype=torch.float64, device=device)
                    row[l] = squared_errors(fake_inputs(fmt, h, scales[:, l], amax[l]), quantized, h, w)
                    rows.append(row)
        errors = (
            torch.stack(rows).to(device) if rows else torch.zeros(0, L, len(GRID), dtype=torch.float64, device=device)
        )
        losses = exact_totals(st, errors, layer.engine.calibration.schedule.num_groups, "edp")  # [L, A]
        best = torch.argmin(losses, dim=1)
        chosen = scales[best, torch.arange(L, device=best.device)]  # [L, I]
        every = torch.zeros(experts.num_experts, I, dtype=torch.float32, device=device)  # every rank's experts
        every[experts.first : experts.first + L] = chosen
        st.all_reduce(every, over="ep", op=dist.ReduceOp.SUM)
        ratio = losses.gather(1, best[:, None]).double().sum() / losses[:, 0].double().sum().clamp(min=1)
        self._log(layer, g, float(torch.tensor([GRID[b] for b in best.tolist()]).mean()), ratio, 1, "mean alpha")
        s = every.cpu()
        return [self.folds.add(*g.divided, s), self.folds.add(name, W2_COLUMNS, s)]

    def _log(self, layer: LayerWork, g: Group, alpha: float, loss, identity, label: str = "alpha") -> None:
        if layer.state.rank == 0:
            ratio = float(loss) / float(identity) if float(identity) > 0 else 1.0
            logger().info(
                "AWQ %s (%s): %s %.2f, quantized output error %.3f of the identity's",
                g.readers[0][0],
                g.what,
                label,
                alpha,
                ratio,
            )

    def _measure_again(self, layer: LayerWork) -> None:
        """The layer's amax and routed token counts from a run through it folded, in place of the
        statistics run's (and its output, unless GPTQ's run makes it)."""
        mine = [m for m in self.cal.targets if m.startswith(layer.prefix)]
        fresh = Calibrator(None, mine, kv=self.cal.kv)
        with fresh.observing(layer.module, layer.prefix):
            layer.run_calibration(write=self.writes)
        fresh.reduce_amax(layer.state, layer.prefix)
        self.cal.input_amax.update(fresh.input_amax)
        self.cal.expert_amax.update(fresh.expert_amax)
        self.cal.expert_tokens.update(fresh.expert_tokens)
        self.cal.kv_amax.update({m: t for m, t in fresh.kv_amax.items() if m.startswith(layer.prefix)})
