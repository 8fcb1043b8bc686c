"""GPTQ inside the layer-major engine (eprt.quant.loop.engine; its pass: eprt.quant.algorithms.gptq.passes): one
decoder layer at a time.

For each layer, after the statistics run has recorded its inputs' amax (inputs are the quantized
stream of the layers before it), reduced over the ranks (Calibrator.reduce_amax):
1. `LayerGPTQ` sums the layer's routed token counts over the ranks, on copies (the run's own are
   summed once at the end, as without GPTQ);
2. a Hessian pass: each quantized Linear GPTQ runs on sums x x^T over its inputs, one canonical
   unit at a time (dense: one sequence; a routed expert: one work unit, its first projection on the
   expert's input, down on the activation), exactly (eprt.quant.algorithms.gptq.solve.HessianSum), then over the ranks (dense:
   the world; experts: the edp replicas that computed the expert's other units);
   Under the rule's `quantized_inputs` (GPTQParams), the sums are over each row's input as the
   engine quantizes it, x~ (the format's `fake_quantize_input` under the scale the export writes),
   with a cross sum (x - x~)^T x~ beside them, and each weight's aim moves to the one that computes
   w x best from x~ (eprt.quant.algorithms.gptq.solve.input_error_aim) before its sweep;
   with --calibrate-all-experts, a routed expert's sums are over every token of its layer (the
   statistics-only rows of eprt.quant.loop.passes.all_experts, one unit per (expert, group)), as
   its amax are, in place of its routed tokens: every expert is then solved;
3. GPTQ of every such module (a routed expert with fewer than `min_tokens` tokens keeps max
   rounding and is listed), each rank alike for what it holds, its weights set in place to what
   the export writes; under awq+gptq, its scales are the clipped weight's (AWQ's clip,
   eprt.quant.algorithms.awq.clip) and the sweep aims at the weight without the clip, so that the columns
   after a clipped element take up its clipping error too;
4. the rest of the layer is fake-quantized with the export's numerics (eprt.quant.loop.passes.quantized_layer,
   eprt.quant.preview.fake_quantize: the other weights, inputs through their input scales, keys
   and values through FP8 with an FP8 KV cache) and runs again to make the next layer's input.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from eprt.loading.resolved import ResolvedCheckpoint
from eprt.models.moe import Experts
from eprt.models.taps import tapped
from eprt.parallel import ParallelState
from eprt.progress import logger
from eprt.quant.algorithms.awq.folds import FoldedCheckpoint
from eprt.quant.algorithms.gptq.record import W2, W13
from eprt.quant.algorithms.gptq.solve import HessianSum, columns_of, gptq, input_error_aim
from eprt.quant.algorithms.registry import GPTQRunOptions, params_of
from eprt.quant.calibrated import CalibrationRecord
from eprt.quant.formats import weight_format
from eprt.quant.formats.base import WeightFormat
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.preview import expert_input_scales
from eprt.quant.scales import EXPERT_PIECES, Scales, as_quantized
from eprt.storage.checkpoint import Checkpoint

ALGORITHM = "gptq"
# Routed experts solved together: the column sweep's Python loop runs once per stack, not per
# expert; each comes out as if alone (eprt.quant.algorithms.gptq.solve.gptq), so the stack size changes no bit. The
# memory plan sizes the stack to the memory free beside the rest of the run (eprt.quant.run.planner), up to
# this many: beyond it the loop's share of the solve is already small.
MOST_EXPERTS_STACKED = 16
# Under `quantized_inputs`, the bound of the sums' rows as a multiple of the input amax: a quantized
# input's block reaches past its amax by its scale's rounding (NVFP4: E4M3's, at most 1/16), and
# its error stays below its amax.
QUANTIZED_INPUT_BOUND = 2.0


class GPTQResults:
    """This rank's GPTQ weights so far, in the export's encoding (eprt.quant.algorithms.gptq.record):
    dense: Linear -> codes; experts: experts module -> (first projection's codes, down's) of its local
    experts; skipped: experts module -> the global ids of the experts kept at max rounding."""

    def __init__(self):
        self.dense: dict[str, torch.Tensor] = {}
        self.experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.skipped: dict[str, list[int]] = {}

    def modules(self) -> set[str]:
        return set(self.dense) | set(self.experts)

    def tensors(self, modules: set[str]) -> dict[str, torch.Tensor]:
        """What a layer boundary saves of `modules` for --resume (eprt.quant.run.workdir)."""
        out = {f"gptq/{m}": t for m, t in self.dense.items() if m in modules}
        for m, (codes_in, codes_down) in ((m, pair) for m, pair in self.experts.items() if m in modules):
            out[f"{W13}/{m}"], out[f"{W2}/{m}"] = codes_in, codes_down  # as the record names them
            out[f"gptq_skipped/{m}"] = torch.tensor(self.skipped.get(m, []), dtype=torch.int64)
        return out

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, t in tensors.items():
            kind, _, name = key.partition("/")
            if kind == "gptq":
                self.dense[name] = t.cpu()
            elif kind == W13:
                self.experts[name] = (t.cpu(), tensors[f"{W2}/{name}"].cpu())
            elif kind == "gptq_skipped":
                self.skipped[name] = t.tolist()

    def summary(self) -> dict:
        return {m: ids for m, ids in self.skipped.items() if ids}

    def apply(self, model, ck: Checkpoint, formats: dict[str, str], first_expert: int) -> set[str]:
        """Set GPTQ's weights (dequantized, under the export's scales from the original weights in
        `ck`) into `model`'s modules (routed experts: this rank's, the first global id
        `first_expert`); returns the modules set, for eprt.quant.preview.fake_quantize."""
        scales = Scales.of_checkpoint(ck, formats, CalibrationRecord())
        present = {name for name, _ in model.named_modules()}
        done = set()
        with torch.no_grad():
            for m, codes in self.dense.items():
                if m in present:
                    w = as_quantized(ck, f"{m}.weight", formats[m], ck.read(f"{m}.weight"))
                    weight = model.get_submodule(m).weight
                    weight.copy_(_decode(formats[m], codes, w, scales.weight_scale(m)).to(weight.dtype))
                    done.add(m)
            for m, pair in self.experts.items():
                if m not in present:
                    continue
                experts = model.get_submodule(m)
                for (kind, param), codes in zip(experts.projections().items(), pair):
                    name = f"{m}.{kind}"
                    for local in range(param.shape[0]):
                        e = first_expert + local
                        row = as_quantized(ck, name, formats[m], ck.read(name, rows=(e, e + 1))[0])
                        scale = scales.expert_weight_scale(m, row)
                        w = _decode(formats[m], codes[local], row, scale, EXPERT_PIECES[kind])
                        param[local].copy_(w.to(param.dtype))
                done.add(m)
        return done


def _decode(fmt: str, codes: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, pieces: int = 1) -> torch.Tensor:
    """fp32 weight of GPTQ's `codes` under the scales the export takes from original weight w."""
    return columns_of(fmt, w[None], scale.reshape(1), pieces).decode(codes.to(w.device)[None])[0]


class GPTQRun:
    """What every layer's GPTQ shares: the run, the recipe, the results so far."""

    def __init__(
        self,
        state: ParallelState,
        rc: ResolvedCheckpoint,
        recipe,
        targets: list[str],
        *,
        tokens: int,
        min_tokens: int = GPTQRunOptions.min_tokens,
        expert_stack: int = MOST_EXPERTS_STACKED,
    ):
        self.state, self.rc, self.recipe = state, rc, recipe
        self.ck, self.dtype = rc.ck, rc.dtype
        self.expert_stack = expert_stack  # routed experts solved at once: the memory plan's (MemoryPlan.expert_stack)
        self.formats = {m: recipe.format_of(m) for m in targets}
        self.algorithms = {m: recipe.algorithm_of(m) for m in targets}
        self.tokens, self.min_tokens = tokens, min_tokens  # tokens: every dense Linear's rows, over the run
        self.results = GPTQResults()
        # each module's sweep as its rule sets it (eprt.quant.algorithms.registry.GPTQParams)
        self.params = {m: params_of(ALGORITHM, recipe.params_of(m)) for m in targets if self.uses_gptq(m)}

    def uses_gptq(self, module: str) -> bool:
        return self.recipe.rounding_of(module) == ALGORITHM


class LayerGPTQ:
    """GPTQ of one decoder layer `layer`, whose modules are named `prefix` + their name in it;
    `cal`'s amax of the layer already reduced over the ranks (Calibrator.reduce_amax)."""

    def __init__(self, run: GPTQRun, layer, prefix: str, cal: Calibrator):
        self.run, self.layer, self.prefix = run, layer, prefix
        st = run.state
        mine = lambda names: [n for n in names if n.startswith(prefix)]  # noqa: E731
        self.dense = [m for m in mine(cal.targets) if not isinstance(self._module(m), Experts)]
        self.experts = [m for m in mine(cal.targets) if isinstance(self._module(m), Experts)]
        # this layer's routed token counts summed over the ranks, on copies
        tokens = {
            m: st.all_reduce(cal.expert_tokens[m].clone(), over="edp", op=dist.ReduceOp.SUM) for m in self.experts
        }
        self.stats = CalibrationRecord(cal.input_amax, cal.expert_amax, tokens)
        self.scales = Scales.of_checkpoint(run.ck, run.formats, self.stats, run.algorithms)
        self.gptq_dense = [m for m in self.dense if run.uses_gptq(m)]
        self.gptq_experts = [m for m in self.experts if run.uses_gptq(m)]
        # --calibrate-all-experts: the experts' sums take every token of the layer
        self.all_experts = cal.all_experts
        self.hessians: dict[str, HessianSum] = {}
        self.expert_hessians: dict[str, dict[int, tuple[HessianSum, HessianSum]]] = {}  # local expert -> sums
        # under quantized_inputs: the cross sums (x - x~)^T x~, kept as the Hessians are
        self.crosses: dict[str, HessianSum] = {}
        self.expert_crosses: dict[str, dict[int, tuple[HessianSum, HessianSum]]] = {}

    def _module(self, name: str):
        return self.layer.get_submodule(name[len(self.prefix) :])

    def _read(
        self, module: str, name: str, rows: tuple[int, int] | None = None, unclipped: bool = False
    ) -> torch.Tensor:
        """Original weight `name` of `module` (or its rows), as the export quantizes it (`unclipped`:
        without AWQ's clip, the weight GPTQ aims at under the clipped one's scales)."""
        ck = self.run.ck
        if rows is not None and name not in ck.tensors:  # an MTP layer's experts
            spec = self.run.rc.mtp_stacked[name]
            w = torch.stack([ck.read_expert(spec, e) for e in range(*rows)])
        elif unclipped and isinstance(ck, FoldedCheckpoint):
            w = ck.read_unclipped(name, rows)
        else:
            w = ck.read(name, rows)
        return as_quantized(ck, self.run.rc.source_tensor(name), self.run.formats[module], w)

    @property
    def needs_hessians(self) -> bool:
        return bool(self.gptq_dense or self.gptq_experts)

    # --- the Hessian pass -------------------------------------------------------------------
    @contextlib.contextmanager
    def observing(self) -> Iterator[None]:
        """While the context lasts, each canonical unit's inputs go into the Hessians."""
        with contextlib.ExitStack() as taps:
            self._observe(taps)
            yield

    def _observe(self, taps: contextlib.ExitStack) -> None:
        for m in self.gptq_dense:
            module = self._module(m)
            dim, amax, device = module.weight.shape[1], self.stats.input_amax[m].item(), module.weight.device
            if self.run.params[m].quantized_inputs:
                quantized = InputsQuantized(self.scales.format(m), self.scales.engine_input_scale(m))
                hs, cross = (HessianSum(dim, QUANTIZED_INPUT_BOUND * amax, self.run.tokens, device) for _ in "hc")
                self.crosses[m] = cross
                add = lambda x, hs=hs, cross=cross, q=quantized: q.add(x, hs, cross)  # noqa: E731
            else:
                hs = HessianSum(dim, amax, self.run.tokens, device)
                add = hs.add
            self.hessians[m] = hs
            # the dense part runs one sequence a call (calls side by side): each call is one unit
            hook = lambda _m, args, add=add: add(args[0].reshape(-1, args[0].shape[-1]))  # noqa: E731
            taps.callback(module.register_forward_pre_hook(hook).remove)
        for m in self.gptq_experts:
            self._observe_experts(m, taps)

    def _observe_experts(self, m: str, taps: contextlib.ExitStack) -> None:
        experts = self._module(m)
        in_amax, down_amax = self.stats.expert_input_amax[m]
        # each expert's rows: its routed tokens, or every token of the run (--calibrate-all-experts)
        tokens = [self.run.tokens] * experts.count if self.all_experts else self.stats.expert_tokens[m].tolist()
        (D, I), device = (experts.w_in.shape[2], experts.w_out.shape[2]), experts.w_in.device
        solved = [(l, n) for l, n in enumerate(tokens) if n >= self.run.min_tokens]
        quantized = self.run.params[m].quantized_inputs
        bound = QUANTIZED_INPUT_BOUND if quantized else 1.0

        def sums_of() -> dict[int, tuple[HessianSum, HessianSum]]:
            return {
                l: (
                    HessianSum(D, bound * in_amax[l].item(), n, device),
                    HessianSum(I, bound * down_amax[l].item(), n, device),
                )
                for l, n in solved
            }

        sums, crosses, inputs = sums_of(), None, None
        if quantized:
            fmt, leaves = self.scales.format(m), experts.pieces.leaves
            in_scales = expert_input_scales(self.scales, m, leaves, self.run.state)
            inputs = tuple(InputsQuantized(fmt, in_scales[leaf]) for leaf in leaves)
            crosses = self.expert_crosses[m] = sums_of()
        self.expert_hessians[m] = sums
        if self.all_experts:
            every = lambda l, x, h, rows_U: _add_units(sums, x, h, _one_expert(l, rows_U), crosses, inputs)  # noqa: E731
            taps.enter_context(tapped(experts, every_expert=every))
        else:
            add = lambda x, h, rows_LU: _add_units(sums, x, h, rows_LU, crosses, inputs)  # noqa: E731
            taps.enter_context(tapped(experts, units=add))

    # --- the solve and the quantized layer ----------------------------------------------------
    @property
    def modules(self) -> set[str]:
        """The modules GPTQ runs on: `quantize` sets their weights (the engine fake-quantizes the others)."""
        return {*self.gptq_dense, *self.gptq_experts}

    def quantize(self) -> None:
        """Sum the Hessians over the ranks, run GPTQ, set the weights of `modules` to what the
        export writes and record their codes."""
        st, run = self.run.state, self.run
        for hs in (*self.hessians.values(), *self.crosses.values()):
            st.all_reduce(hs.total, over="dp", op=dist.ReduceOp.SUM)
        for sums in (*self.expert_hessians.values(), *self.expert_crosses.values()):
            for pair in sums.values():
                for hs in pair:
                    st.all_reduce(hs.total, over="edp", op=dist.ReduceOp.SUM)
        with torch.no_grad():
            for m in self.gptq_dense:
                module = self._module(m)
                w = self._read(m, f"{m}.weight").to(module.weight.device)
                cols = columns_of(run.formats[m], w[None], self.scales.weight_scale(m).reshape(1))
                aim = self._read(m, f"{m}.weight", unclipped=True).to(module.weight.device)
                p, hs = run.params[m], self.hessians[m]
                if m in self.crosses:
                    aim = input_error_aim(aim, hs.hessian(), self.crosses[m].hessian(), p.damp)
                # the fp64 Hessian made as it is factored, held by the solve alone (as the experts')
                order = p.orders_columns(weight_format(run.formats[m]))
                q = gptq(aim[None], (hs.hessian() for _ in range(1)), cols, block=p.block, damp=p.damp, actorder=order)
                run.results.dense[m] = cols.encode(q)[0].cpu()
                module.weight.copy_(q[0].to(module.weight.dtype))
            for m in self.gptq_experts:
                self._quantize_experts(m)

    def free(self) -> None:
        """Drop the Hessians, once solved: the quantized streams run without them."""
        for sums in (self.hessians, self.expert_hessians, self.crosses, self.expert_crosses):
            sums.clear()

    def _quantize_experts(self, m: str) -> None:
        """Every local expert's stacked projections as exported: GPTQ's (solved the run's expert_stack at a time) for
        the experts with enough tokens, max rounding's (the module's scales) for the others."""
        run, experts = self.run, self._module(m)
        first, L = experts.first, experts.count
        sums = self.expert_hessians[m]
        codes = {}
        for k, (kind, param) in enumerate(experts.projections().items()):
            name, fmt = f"{m}.{kind}", run.formats[m]
            rows = self._read(m, name, (first, first + L)).to(param.device)
            aims = self._read(m, name, (first, first + L), unclipped=True).to(param.device)
            scales = torch.stack([self.scales.expert_weight_scale(m, row) for row in rows]).to(param.device)
            for l in (l for l in range(L) if l not in sums):  # the export's own codes
                f, pieces = self.scales.format(m), EXPERT_PIECES[kind]  # gate and up apart where blocks span rows
                t = f.quantize_stacked(rows[l], scales[l], self.scales.searched(m), pieces)
                param[l].copy_(f.dequantize_stacked(t, param.dtype, pieces))
                codes[(kind, l)] = t["weight"]
            solved = sorted(sums)
            stack = run.expert_stack
            for j in range(0, len(solved), stack):
                ids = solved[j : j + stack]
                cols = columns_of(fmt, rows[ids], scales[ids], EXPERT_PIECES[kind])
                # each fp64 Hessian made as its factor is computed, not a stack of them beside the factors
                p = run.params[m]
                aim = aims[ids]
                if m in self.expert_crosses:
                    crosses = self.expert_crosses[m]
                    aim = torch.stack(
                        [input_error_aim(aims[l], sums[l][k].hessian(), crosses[l][k].hessian(), p.damp) for l in ids]
                    )
                order = p.orders_columns(weight_format(fmt))
                q = gptq(aim, (sums[l][k].hessian() for l in ids), cols, block=p.block, damp=p.damp, actorder=order)
                param[ids] = q.to(param.dtype)
                for l, code in zip(ids, cols.encode(q)):
                    codes[(kind, l)] = code
        run.results.experts[m] = tuple(
            torch.stack([codes[(k, l)].cpu() for l in range(L)]) for k in experts.pieces.leaves
        )
        # the experts kept at max rounding, over every ep rank
        skipped = torch.zeros(experts.num_experts, dtype=torch.int64, device=experts.w_in.device)
        for l in range(L):
            skipped[first + l] = int(l not in sums)
        run.state.all_reduce(skipped, over="ep", op=dist.ReduceOp.MAX)
        run.results.skipped[m] = skipped.nonzero().view(-1).tolist()
        if run.results.skipped[m] and run.state.rank == 0:
            logger().info(
                "%s: GPTQ kept max rounding for experts %s (fewer than %d tokens, --gptq-min-tokens)",
                m,
                run.results.skipped[m],
                run.min_tokens,
            )


class InputsQuantized:
    """A Linear's inputs as the engine quantizes them (format `fmt` under input scale `scale`), into
    its sums under quantized_inputs: the Hessian of x~ and the cross sum (x - x~)^T x~."""

    def __init__(self, fmt: WeightFormat, scale: torch.Tensor | None):
        self.fmt, self.scale = fmt, scale

    def add(self, x: torch.Tensor, hessian: HessianSum, cross: HessianSum) -> None:
        x_q = self.fmt.fake_quantize_input(x, self.scale)
        hessian.add(x_q)
        cross.add(x.double() - x_q.double(), x_q)


def _one_expert(local: int, rows_per_unit_U: torch.Tensor) -> torch.Tensor:
    """[local + 1, U]: local expert `local`'s rows by work unit as `_add_units` reads the routed
    ones (the experts before it with none)."""
    rows = torch.zeros(local + 1, rows_per_unit_U.shape[0], dtype=rows_per_unit_U.dtype)
    rows[local] = rows_per_unit_U.cpu()
    return rows


def _add_units(
    sums: dict[int, tuple[HessianSum, HessianSum]],
    x_sorted: torch.Tensor,
    h_sorted: torch.Tensor,
    rows_per_unit_LU: torch.Tensor,
    crosses: dict[int, tuple[HessianSum, HessianSum]] | None = None,
    inputs: tuple[InputsQuantized, InputsQuantized] | None = None,
) -> None:
    """Each (local expert, work unit)'s rows, as `Experts.forward_units` computed them, into the
    expert's sums (those with enough tokens); with `crosses`, each projection's inputs as `inputs`
    quantize them into its Hessian and its cross sum."""
    counts = rows_per_unit_LU.tolist()
    start = 0
    for l, row in enumerate(counts):
        for n in row:
            if n and l in sums:
                for k, rows in enumerate((x_sorted[start : start + n], h_sorted[start : start + n])):
                    if crosses is None:
                        sums[l][k].add(rows)
                    else:
                        inputs[k].add(rows, sums[l][k], crosses[l][k])
            start += n
