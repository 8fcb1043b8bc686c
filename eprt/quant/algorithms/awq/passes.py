"""AWQ (Lin et al., 2023) as a pass: per-channel scales for each balance group of a layer
(eprt.quant.algorithms.awq.groups: what makes a tensor and the Linears that read it), searched on the group's
own calibration inputs (eprt.quant.algorithms.awq.search: the candidates and their errors) and folded
into the weights (eprt.quant.algorithms.awq.folds).

For each layer:
1. on the statistics run, each group's tensor is kept as its first reader reads it, one canonical
   unit at a time: a dense reader's input per call (one sequence), the routed experts' inputs and
   activations per (expert, work unit);
2. in `reference`, from those samples: each group's per-channel mean |x| (each unit's fp64 sum
   rounded to int64 fixed point, summed exactly over the ranks) and amax; candidates for alpha = k / 20 tried coarse to fine (k 0, 4, 8,
   12, 16, then +-2 and +-1 around the best), each scored by the group's quantized output error
   (a gated MLP's gate and up through its down projection), a sum of squares per unit turned
   into int64 fixed point and summed over the ranks exactly, so every rank chooses the same alpha
   at every layout (the routed experts' activations: each expert its own alpha);
3. the fold of each group's best candidate, read back into the layer through the folded
   checkpoint, as the export reads it; then AWQ's clipping half (eprt.quant.algorithms.awq.clip): each
   quantized reader in a 4-bit block format gets, per block of its folded weight, the clip of
   least output error on the group's samples, folded in after the scales (under awq+gptq, GPTQ
   keeps the clipped weight's scales and aims at the unclipped weight: eprt.quant.algorithms.gptq.layer);
4. a run of the calibration sequences through the folded layer measures its amax again (the
   readers' inputs are now x / s, every later module's move by the folds' roundings) and the routed
   token counts (a bf16 router's choices may move with its rounding), in place of the statistics
   run's (with --calibrate-all-experts, every expert's rows of the folded layer too), and makes
   the calibration sequences' output unless GPTQ's quantized run makes it.

The samples are the layer's inputs to its groups, held until the search is done (about the hidden
states once per group, and the routed rows once: eprt.quant.algorithms.awq.plan prices them); the statistics
run only observes. The multi-token-prediction layers are left as they are.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import partial

import torch
import torch.distributed as dist

from eprt.loading.resolved import place_tensors
from eprt.models.layers import GatedMLP
from eprt.models.moe import Experts
from eprt.models.taps import tapped
from eprt.progress import logger
from eprt.quant.algorithms.awq.clip import clip_steps, clips, reader_hessian
from eprt.quant.algorithms.awq.folds import CLIP, W2_CLIP, W2_COLUMNS, W13_CLIP, W13_COLUMNS, ExpertRows, Folds
from eprt.quant.algorithms.awq.groups import Group, layer_groups
from eprt.quant.algorithms.awq.search import (
    STEPS,
    SUM_SHIFT,
    Reader,
    candidates,
    channel_sums,
    exact_totals,
    fake_weights,
    readers_errors,
    scored,
    search,
    unit_errors,
)
from eprt.quant.algorithms.gptq.solve import HessianSum
from eprt.quant.formats import WeightFormat, weight_format
from eprt.quant.fusion import siblings
from eprt.quant.loop.calibrate import CalibrationError, Calibrator
from eprt.quant.loop.engine import LayerWork, Pass
from eprt.quant.loop.passes.all_experts import measure
from eprt.quant.numerics import abs_amax
from eprt.quant.recipe import Recipe

NAME = "awq"  # its name in the registry and in a recipe (eprt.quant.algorithms.registry)


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
    per_sequence_work = True  # the search scores every unit of the calibration sequences

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
            if scored and all(self.recipe.runs(m, NAME) for m in scored):
                out.append(g)
            elif any(self.recipe.runs(m, NAME) for m in scored):
                left_out.append(f"{g.readers[0][0]}'s input ({g.what}): its other readers' rules are not AWQ")
        if layer.state.rank == 0:
            for what in left_out:
                logger().info("AWQ leaves out %s", what)
        return out

    def measures_again(self) -> bool:
        """Whether the running layer's statistics run is measured again, folded (`_measure_again`)."""
        return bool(self.groups)

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
                self._place(layer, [n for g in groups for n in self._balance(layer, g)])
                clipped = [n for g in groups for n in self._clip(layer, g)]
            self.dense, self.experts = {}, {}
            self._place(layer, clipped)
            self._measure_again(layer)
        elif self.writes:
            layer.run_calibration(write=True)

    def _place(self, layer: LayerWork, changed: list[str]) -> None:
        """Read the tensors `changed` into the layer again, through the folds."""
        if changed:
            place_tensors(
                layer.engine.rc, layer.module, sorted(set(changed)), device=layer.state.device, prefix=layer.prefix
            )

    # --- the clipping search (eprt.quant.algorithms.awq.clip) ---------------------------------------------
    def _clip(self, layer: LayerWork, g: Group) -> list[str]:
        """Search the clip of each quantized reader of group g, whose scales are folded into the
        layer; returns the tensors the clips change."""
        readers = [(m, kind) for m, kind in g.readers if m in self.targets and clips(self._format(m))]
        if g.per_expert:
            changed = [
                self._clip_experts(layer, m, W2_CLIP, lambda ex: ex.w_out, self.experts[m].h) for m, _ in readers
            ]
            return [n for n in changed if n]
        first, st = g.readers[0][0], layer.state
        inputs = [x.reshape(-1, x.shape[-1]) for x in self.dense[first]]
        dim, device = self._sub(layer, first).weight.shape[1], self._sub(layer, first).weight.device
        amax = torch.zeros((), dtype=torch.float32, device=device)
        for x in inputs:
            torch.maximum(amax, x.abs().max().float(), out=amax)
        tokens = torch.tensor(sum(x.shape[0] for x in inputs), dtype=torch.int64, device=device)
        st.all_reduce(amax, over="dp", op=dist.ReduceOp.MAX)
        st.all_reduce(tokens, over="dp", op=dist.ReduceOp.SUM)
        totals: dict[int, torch.Tensor] = {}  # by block size: the input's Hessian blocks over the ranks

        def blocks_of(size: int) -> torch.Tensor:
            if size not in totals:
                hs = HessianSum(dim, amax.item(), int(tokens), device, block=size)
                for x in inputs:
                    hs.add(x)
                st.all_reduce(hs.total, over="dp", op=dist.ReduceOp.SUM)
                totals[size] = hs.hessian()
            return totals[size]

        changed = []
        for m, kind in readers:
            module, fmt = self._sub(layer, m), self._format(m)
            s = self.folds.by_module[m][kind]
            if isinstance(module, Experts):
                x = self.experts[m].x
                changed.append(self._clip_experts(layer, m, W13_CLIP, lambda ex: ex.w_in, x, s))
                continue
            w = module.weight.detach()
            kept = None
            if fmt.weight_scale_leaf is not None:  # a per-tensor scale from the fused siblings' amax
                kept = max(abs_amax(self._sub(layer, n).weight) for n in siblings(m, self.targets, fmt))
            w_scale = fmt.scale(kept if kept is not None else abs_amax(w))
            steps = clip_steps(fmt, w, w_scale, reader_hessian(blocks_of(fmt.group_size), s), kept)
            if steps.any():
                changed.append(self.folds.add(m, CLIP, steps.cpu()))
        return [n for n in changed if n]

    def _clip_experts(self, layer: LayerWork, name: str, kind: str, weights, units, s=None) -> str | None:
        """The clips of this rank's routed experts' gate/up (its input's Hessian `units` per local expert,
        the group's scale s) or down (its activation's; each expert's own scale), held as this rank's
        rows; returns the tensor they change, None where no block of any rank's experts clips."""
        st, experts, fmt = layer.state, self._sub(layer, name), self._format(name)
        stack, first, L = weights(experts).detach(), experts.first, experts.count
        scales = self.folds.by_module[name][W2_COLUMNS][first : first + L] if s is None else [s] * L
        device, size = stack.device, fmt.group_size
        amax = torch.zeros(L, dtype=torch.float32, device=device)
        tokens = torch.zeros(L, dtype=torch.int64, device=device)
        for l, xs in enumerate(units):
            for x in xs:
                torch.maximum(amax[l], x.abs().max().float(), out=amax[l])
                tokens[l] += x.shape[0]
        st.all_reduce(amax, over="edp", op=dist.ReduceOp.MAX)
        st.all_reduce(tokens, over="edp", op=dist.ReduceOp.SUM)
        mine = torch.zeros(L, stack.shape[1], stack.shape[2] // size, dtype=torch.uint8, device=device)
        for l in range(L):
            hs = HessianSum(stack.shape[2], amax[l].item(), int(tokens[l]), device, block=size)
            for x in units[l]:
                hs.add(x)
            st.all_reduce(hs.total, over="edp", op=dist.ReduceOp.SUM)
            row = stack[l]
            if fmt.exact_weight_scale(row) is not None:  # an MXFP4 source's row, kept exactly: no error to clip away
                continue
            kept = abs_amax(row) if fmt.weight_scale_leaf is not None else None
            h = reader_hessian(hs.hessian(), scales[l])
            mine[l] = clip_steps(fmt, row, fmt.scale(abs_amax(row)), h, kept)
        # every rank holds its own experts' steps; the fold is there where any expert's block clips
        any_clip = torch.tensor(int(mine.any()), device=device)
        st.all_reduce(any_clip, over="ep", op=dist.ReduceOp.MAX)
        return self.folds.add(name, kind, ExpertRows(mine.cpu(), first)) if int(any_clip) else None

    def _format(self, module: str) -> WeightFormat:
        return weight_format(self.recipe.format_of(module))

    # --- the search ---------------------------------------------------------------------------
    def _balance(self, layer: LayerWork, g: Group) -> list[str]:
        """Search group g's scales and fold the best in; returns the tensors the fold changes."""
        if g.per_expert:
            return self._balance_experts(layer, g)
        st, first = layer.state, g.readers[0][0]
        dim, device = self._sub(layer, first).weight.shape[1], self._sub(layer, first).weight.device
        inputs = [x.reshape(-1, dim) for x in self.dense[first]]
        sums = sum((channel_sums(x) for x in inputs), torch.zeros(dim, dtype=torch.int64, device=device))
        tokens = torch.tensor(sum(x.shape[0] for x in inputs), dtype=torch.int64, device=device)
        amax = torch.zeros(dim, dtype=torch.float32, device=device)
        for x in inputs:
            torch.maximum(amax, x.abs().amax(0).float(), out=amax)
        st.all_reduce(sums, over="dp", op=dist.ReduceOp.SUM)
        st.all_reduce(tokens, over="dp", op=dist.ReduceOp.SUM)
        st.all_reduce(amax, over="dp", op=dist.ReduceOp.MAX)
        if not torch.isfinite(amax).all():
            raise CalibrationError(f"AWQ: {first}'s input holds NaN or infinity")
        dense, experts = self._terms(layer, g)
        x_mean = sums.double() / 2.0**SUM_SHIFT / max(int(tokens), 1)
        units = [scored(x) for x in inputs]
        schedule = layer.engine.calibration.schedule
        total_units = schedule.num_sequences + sum(ex.num_experts for _, ex, _ in experts) * schedule.num_groups

        def scales_of(ks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """(the divided tensor's scales, its readers')"""
            if g.repeat is None:
                return (scales := candidates(x_mean, ks)), scales
            # v's channel: the means over the query heads that read it; o's scale: v's repeated
            heads, head_dim = g.repeat
            per_kv = lambda m: m.view(-1, heads, head_dim).mean(1).reshape(-1)  # noqa: E731
            divided = candidates(per_kv(x_mean), ks)
            return divided, g.reader_scales(divided)

        # each reader's reference outputs on each unit, made in the first round and kept to the last
        dense_refs = [[None] * len(units) for _ in dense]
        expert_refs = {name: [[None] * len(xs) for xs in self.experts[name].x] for name, _, _ in experts}

        def losses_of(ks: torch.Tensor) -> torch.Tensor:
            scales = scales_of(ks[:, 0])[1]
            rows = [torch.zeros(len(ks), dtype=torch.float64, device=device) for _ in units]  # one per unit
            kept = {}  # the units' quantized inputs by format, for every dense reader
            for (fmt, w, parts, down, act), refs in zip(dense, dense_refs):  # one reader's candidates at a time
                reader = Reader(fmt, w, self._fake(fmt, parts, scales), down, act)
                for row, err in zip(rows, unit_errors(reader, units, scales, amax, kept, refs)):
                    row += err
            del kept
            for name, ex, fmt in experts:
                samples = self.experts[name]

                def gate_up(l: int, ex=ex, fmt=fmt) -> Reader:
                    gate_up = ex.w_in[l].detach()
                    down = ex.w_out[l].detach().float()
                    return Reader(fmt, gate_up.float(), fake_weights(fmt, gate_up, W13_COLUMNS, scales), down, ex.act)

                readers = [(partial(gate_up, l), [scored(x) for x in samples.x[l]]) for l in range(ex.count)]
                rows += readers_errors(readers, fmt, scales, amax, expert_refs[name])
            errors = torch.stack(rows) if rows else torch.zeros(0, len(ks), dtype=torch.float64, device=device)
            return exact_totals(st, errors, total_units, "dp")[None]

        best, (loss, identity) = (t[0] for t in search(losses_of, 1, device))
        self._log(layer, g, int(best) / STEPS, float(loss), float(identity))
        divided, s = (t[0].cpu() for t in scales_of(best[None]))
        return [self.folds.add(*g.divided, divided), *(self.folds.add(m, kind, s) for m, kind in g.readers)]

    def _terms(self, layer: LayerWork, g: Group):
        """Group g's quantized readers: (the dense terms, each (format, weight [out, C] fp32, the
        modules' weights with their fold kinds, a gated MLP's down fp32 or None, its activation);
        the routed experts, each (name, module, format)). A gated MLP's gate_proj and up_proj of
        one format make one term, scored on the MLP's output."""
        quantized = [(m, kind) for m, kind in g.readers if m in self.targets]
        dense, experts, paired = [], [], set()
        for m, kind in quantized:
            module, fmt = self._sub(layer, m), weight_format(self.recipe.format_of(m))
            if isinstance(module, Experts):
                experts.append((m, module, fmt))
                continue
            if m in paired:
                continue
            mlp_name = m.rpartition(".")[0]
            mlp = self._sub(layer, mlp_name) if m.endswith(".gate_proj") else None
            up = f"{mlp_name}.up_proj"
            if (
                isinstance(mlp, GatedMLP)
                and (up, kind) in quantized
                and weight_format(self.recipe.format_of(up)) == fmt
            ):
                paired.add(up)
                w = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]).detach()
                parts = [(mlp.gate_proj.weight.detach(), kind), (mlp.up_proj.weight.detach(), kind)]
                dense.append((fmt, w.float(), parts, mlp.down_proj.weight.detach().float(), mlp.act))
            else:
                dense.append((fmt, module.weight.detach().float(), [(module.weight.detach(), kind)], None, None))
        return dense, experts

    @staticmethod
    def _fake(fmt: WeightFormat, parts, scales: torch.Tensor) -> torch.Tensor:
        """A term's candidates fake-quantized [A, C, out]: each module's weight its own, side by side."""
        out = torch.empty(scales.shape[0], scales.shape[-1], sum(w.shape[0] for w, _ in parts), device=scales.device)
        first = 0
        for w, kind in parts:
            fake_weights(fmt, w, kind, scales, out[..., first : first + w.shape[0]])
            first += w.shape[0]
        return out

    def _balance_experts(self, layer: LayerWork, g: Group) -> list[str]:
        """The routed experts' activations: each expert's scales of its own, from its units."""
        st, name = layer.state, g.readers[0][0]
        experts: Experts = self._sub(layer, name)
        samples, fmt = self.experts[name], weight_format(self.recipe.format_of(name))
        L, I, device = experts.count, experts.w_out.shape[2], experts.w_out.device
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
        x_mean = sums.double() / 2.0**SUM_SHIFT / tokens.clamp(min=1)[:, None]
        down = experts.w_out.detach()
        refs = [[None] * len(units) for units in samples.h]  # each unit's reference, kept from round to round

        def losses_of(ks: torch.Tensor) -> torch.Tensor:  # ks [A, L]: each expert's own candidates
            scales = candidates(x_mean, ks)  # [A, L, I]
            rows = []  # one per unit: [L, A], the unit's expert's row filled
            for l, units in enumerate(samples.h):
                if units:
                    reader = Reader(fmt, down[l].float(), fake_weights(fmt, down[l], W2_COLUMNS, scales[:, l]))
                    scored_units = [scored(h) for h in units]
                    for err in unit_errors(reader, scored_units, scales[:, l], amax[l], refs=refs[l]):
                        row = torch.zeros(L, len(ks), dtype=torch.float64, device=device)
                        row[l] = err
                        rows.append(row)
            errors = torch.stack(rows) if rows else torch.zeros(0, L, len(ks), dtype=torch.float64, device=device)
            return exact_totals(st, errors, layer.engine.calibration.schedule.num_groups, "edp")  # [L, A]

        best, losses = search(losses_of, L, device)
        chosen = candidates(x_mean, best[None])[0]  # [L, I]
        every = torch.zeros(experts.num_experts, I, dtype=torch.float32, device=device)  # every rank's experts
        every[experts.first : experts.first + L] = chosen
        st.all_reduce(every, over="ep", op=dist.ReduceOp.SUM)
        ratio = losses[:, 0].sum() / losses[:, 1].sum().clamp(min=1e-300)
        self._log(layer, g, best.double().mean().item() / STEPS, ratio, 1, "mean alpha")
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
        fresh = Calibrator(None, mine, kv=self.cal.kv, all_experts=self.cal.all_experts, headroom=self.cal.headroom)
        measure(layer, fresh, write=self.writes)  # with --calibrate-all-experts, every folded expert's rows too
        self.cal.input_amax.update(fresh.input_amax)
        self.cal.expert_amax.update(fresh.expert_amax)
        self.cal.expert_tokens.update(fresh.expert_tokens)
        self.cal.expert_all_tokens.update(fresh.expert_all_tokens)
        self.cal.kv_amax.update({m: t for m, t in fresh.kv_amax.items() if m.startswith(layer.prefix)})
