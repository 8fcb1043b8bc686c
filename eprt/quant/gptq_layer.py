"""GPTQ inside the layer-major engine (eprt.quant.engine): one decoder layer at a time.

For each layer, after the max pass has recorded its inputs' amax (inputs are the quantized stream
of the layers before it):
1. `LayerGPTQ` reduces a copy of that layer's statistics over the ranks (the run's own
   statistics are reduced once at the end, as without GPTQ);
2. a Hessian pass: each quantized Linear GPTQ runs on sums x x^T over its inputs, one canonical
   unit at a time (dense: one sequence; a routed expert: one work unit, w13 on the expert's input,
   w2 on the gated activation), exactly (eprt.quant.gptq.HessianSum), then over the ranks (dense:
   the world; experts: the edp replicas that computed the expert's other units);
3. GPTQ of every such module (a routed expert with fewer than `min_tokens` tokens keeps max
   rounding and is listed), each rank alike for what it holds;
4. the layer is fake-quantized in place with the export's numerics (weights as exported, GPTQ's
   where it ran; inputs through their input scales; keys and values through FP8 with an FP8 KV
   cache) and run again to make the next layer's input.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from eprt.models.moe import Experts
from eprt.progress import logger
from eprt.quant.calibrate import Calibrator
from eprt.quant.calibrated import CalibrationState
from eprt.quant.fp8 import fake_quant_fp8, fp8_scale
from eprt.quant.gptq import HessianSum, columns_of, gptq
from eprt.quant.preview import fake_expert_inputs, fake_inputs
from eprt.quant.scales import EXPERT_KINDS, Scales, as_quantized, dequantize_weight
from eprt.storage.checkpoint import Checkpoint

ALGORITHM = "gptq"
DEFAULT_MIN_TOKENS = 128  # a routed expert with fewer keeps max rounding
# Routed experts solved together: the column sweep's Python loop runs once per stack, not per
# expert; each comes out as if alone (eprt.quant.gptq.gptq), so the stack size changes no bit.
EXPERT_STACK = 16


class GPTQResults:
    """This rank's GPTQ weights so far, in the export's encoding (eprt.quant.calibrated):
    dense: Linear -> codes; experts: experts module -> (w13 codes, w2 codes) of its local
    experts; skipped: experts module -> the global ids of the experts kept at max rounding."""

    def __init__(self):
        self.dense: dict[str, torch.Tensor] = {}
        self.experts: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.skipped: dict[str, list[int]] = {}

    def decoder(self, ck: Checkpoint, formats: dict[str, str], first_expert: int) -> "GPTQWeights":
        return GPTQWeights(self, ck, formats, first_expert)

    def tensors(self) -> dict[str, torch.Tensor]:
        """What a layer boundary saves for --resume (eprt.quant.workdir)."""
        out = {f"gptq/{m}": t for m, t in self.dense.items()}
        for m, (w13, w2) in self.experts.items():
            out[f"gptq_w13/{m}"], out[f"gptq_w2/{m}"] = w13, w2
            out[f"gptq_skipped/{m}"] = torch.tensor(self.skipped.get(m, []), dtype=torch.int64)
        return out

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        for key, t in tensors.items():
            kind, _, name = key.partition("/")
            if kind == "gptq":
                self.dense[name] = t.cpu()
            elif kind == "gptq_w13":
                self.experts[name] = (t.cpu(), tensors[f"gptq_w2/{name}"].cpu())
            elif kind == "gptq_skipped":
                self.skipped[name] = t.tolist()

    def summary(self) -> dict:
        return {m: ids for m, ids in self.skipped.items() if ids}


class GPTQWeights:
    """GPTQ's weights dequantized (for the preview), with the export's scales from the original
    weights in the checkpoint; `first_expert`: the global id of this rank's first expert."""

    def __init__(self, results: GPTQResults, ck: Checkpoint, formats: dict[str, str], first_expert: int):
        self.dense, self.experts, self.ck, self.first = results.dense, results.experts, ck, first_expert
        self.formats, self.scales = formats, Scales.of_checkpoint(ck, formats, CalibrationState())

    def weight(self, module: str) -> torch.Tensor:
        w = as_quantized(self.ck, f"{module}.weight", self.formats[module], self.ck.read(f"{module}.weight"))
        return _decode(self.formats[module], self.dense[module], w, self.scales.weight_scale(module))

    def expert_weight(self, module: str, kind: str, local: int) -> torch.Tensor:
        e = self.first + local
        name = f"{module}.{kind}"
        row = as_quantized(self.ck, name, self.formats[module], self.ck.read(name, rows=(e, e + 1))[0])
        codes = self.experts[module][EXPERT_KINDS.index(kind)][local]
        return _decode(self.formats[module], codes, row, self.scales.expert_weight_scale(module, row))


def _decode(fmt: str, codes: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 weight of GPTQ's `codes` under the scales the export takes from original weight w."""
    return columns_of(fmt, w[None], scale.reshape(1)).decode(codes.to(w.device)[None])[0]


class GPTQRun:
    """What every layer's GPTQ shares: the run, the recipe, the results so far."""

    def __init__(self, state, ck: Checkpoint, recipe, targets: list[str], *, dtype: torch.dtype, tokens: int,
                 min_tokens: int = DEFAULT_MIN_TOKENS):
        self.state, self.ck, self.recipe, self.dtype = state, ck, recipe, dtype
        self.formats = {m: recipe.format_of(m) for m in targets}
        self.algorithms = {m: recipe.algorithm_of(m) for m in targets}
        self.tokens, self.min_tokens = tokens, min_tokens  # tokens: every dense Linear's rows, over the run
        self.results = GPTQResults()

    def uses_gptq(self, module: str) -> bool:
        return self.recipe.algorithm_of(module) == ALGORITHM


class LayerGPTQ:
    """GPTQ of one decoder layer `layer`, whose modules are named `prefix` + their name in it."""

    def __init__(self, run: GPTQRun, layer, prefix: str, cal: Calibrator):
        self.run, self.layer, self.prefix = run, layer, prefix
        st = run.state
        mine = lambda names: [n for n in names if n.startswith(prefix)]  # noqa: E731
        self.dense = [m for m in mine(cal.targets) if not isinstance(self._module(m), Experts)]
        self.experts = [m for m in mine(cal.targets) if isinstance(self._module(m), Experts)]
        # this layer's statistics reduced over the ranks, on copies
        reduce = lambda t, over, op=dist.ReduceOp.MAX: st.all_reduce(t.clone(), over=over, op=op)  # noqa: E731
        input_amax = {m: reduce(cal.input_amax[m], "dp") for m in self.dense}
        expert_amax = {m: tuple(reduce(t, "edp") for t in cal.expert_amax[m]) for m in self.experts}
        tokens = {m: reduce(cal.expert_tokens[m], "edp", dist.ReduceOp.SUM) for m in self.experts}
        self.kv = {a: tuple(reduce(t, "dp") for t in cal.kv_amax[a]) for a in mine(cal.kv_amax)}
        self.stats = CalibrationState(input_amax, expert_amax, tokens)
        self.scales = Scales.of_checkpoint(run.ck, run.formats, self.stats, run.algorithms)
        self.gptq_dense = [m for m in self.dense if run.uses_gptq(m)]
        self.gptq_experts = [m for m in self.experts if run.uses_gptq(m)]
        self.hessians: dict[str, HessianSum] = {}
        self.expert_hessians: dict[str, dict[int, tuple[HessianSum, HessianSum]]] = {}  # local expert -> sums
        self._undo = []

    def _module(self, name: str):
        return self.layer.get_submodule(name[len(self.prefix):])

    def _read(self, module: str, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Original weight `name` of `module` (or its rows), as the export quantizes it."""
        return as_quantized(self.run.ck, name, self.run.formats[module], self.run.ck.read(name, rows))

    @property
    def needs_hessians(self) -> bool:
        return bool(self.gptq_dense or self.gptq_experts)

    # --- the Hessian pass -------------------------------------------------------------------
    def observe(self) -> None:
        """Hooks that add each canonical unit's inputs to the Hessians (`close` removes them)."""
        for m in self.gptq_dense:
            module = self._module(m)
            hs = HessianSum(module.weight.shape[1], self.stats.input_amax[m].item(), self.run.tokens,
                            module.weight.device)
            self.hessians[m] = hs
            # the dense part runs one sequence at a time: each call is one unit
            hook = lambda _m, args, hs=hs: hs.add(args[0].reshape(-1, args[0].shape[-1]))  # noqa: E731
            self._undo.append(module.register_forward_pre_hook(hook).remove)
        for m in self.gptq_experts:
            experts = self._module(m)
            w13_amax, w2_amax = self.stats.expert_input_amax[m]
            tokens = self.stats.expert_tokens[m].tolist()
            D, I = experts.w13.shape[2], experts.w2.shape[2]
            sums = {l: (HessianSum(D, w13_amax[l].item(), n, experts.w13.device),
                        HessianSum(I, w2_amax[l].item(), n, experts.w13.device))
                    for l, n in enumerate(tokens) if n >= self.run.min_tokens}
            self.expert_hessians[m] = sums
            experts.unit_observer = lambda x, h, rows_LU, sums=sums: _add_units(sums, x, h, rows_LU)
            self._undo.append(lambda e=experts: setattr(e, "unit_observer", None))

    def close(self) -> None:
        for undo in self._undo:
            undo()
        self._undo.clear()

    # --- the solve and the quantized layer ----------------------------------------------------
    def quantize(self) -> None:
        """Sum the Hessians over the ranks, then set every quantized weight of the layer to what the
        export writes (GPTQ's where it ran) and record GPTQ's codes."""
        st, run = self.run.state, self.run
        for hs in self.hessians.values():
            st.all_reduce(hs.total, over="dp", op=dist.ReduceOp.SUM)
        for sums in self.expert_hessians.values():
            for pair in sums.values():
                for hs in pair:
                    st.all_reduce(hs.total, over="edp", op=dist.ReduceOp.SUM)
        with torch.no_grad():
            for m in self.dense:
                module = self._module(m)
                w = self._read(m, f"{m}.weight").to(module.weight.device)
                codes, deq = self._quantize(m, w, self.scales.weight_scale(m), f"{m}.weight",
                                            self.hessians.get(m))
                if codes is not None:
                    run.results.dense[m] = codes.cpu()
                module.weight.copy_(deq.to(module.weight.dtype))
            for m in self.experts:
                self._quantize_experts(m)

    def _quantize(self, m: str, w: torch.Tensor, scale: torch.Tensor, name: str, hs: HessianSum | None):
        """(GPTQ's codes or None, the dequantized weight in fp32) of weight `name` of module m."""
        fmt = self.run.formats[m]
        if hs is None:
            return None, dequantize_weight(fmt, self.scales.quantize_weight(m, w, scale), torch.float32)
        cols = columns_of(fmt, w[None], scale.reshape(1))
        q = gptq(w[None], hs.hessian()[None], cols)
        return cols.encode(q)[0], q[0]

    def _quantize_experts(self, m: str) -> None:
        """Every local expert's w13 and w2 as exported: GPTQ's (solved EXPERT_STACK at a time) for
        the experts with enough tokens, max rounding's for the others."""
        run, experts = self.run, self._module(m)
        first, L = experts.first, experts.count
        sums = self.expert_hessians.get(m)
        codes = {}
        for k, (kind, param) in enumerate(zip(EXPERT_KINDS, (experts.w13, experts.w2))):
            name, fmt = f"{m}.{kind}", run.formats[m]
            rows = self._read(m, name, (first, first + L)).to(param.device)
            scales = torch.stack([self.scales.expert_weight_scale(m, row) for row in rows]).to(param.device)
            deq = torch.empty(rows.shape, dtype=torch.float32, device=param.device)
            kept = [l for l in range(L) if sums is None or l not in sums]
            for l in kept:  # the export's own codes
                t = self.scales.quantize_weight(m, rows[l], scales[l])
                deq[l], codes[(kind, l)] = dequantize_weight(fmt, t, torch.float32), t["weight"]
            solved = sorted(sums) if sums is not None else []
            for j in range(0, len(solved), EXPERT_STACK):
                ids = solved[j:j + EXPERT_STACK]
                cols = columns_of(fmt, rows[ids], scales[ids])
                q = gptq(rows[ids], torch.stack([sums[l][k].hessian() for l in ids]), cols)
                deq[ids] = q
                for l, code in zip(ids, cols.encode(q)):
                    codes[(kind, l)] = code
            param.copy_(deq.to(param.dtype))
        if sums is None:
            return
        run.results.experts[m] = tuple(torch.stack([codes[(k, l)].cpu() for l in range(L)]) for k in EXPERT_KINDS)
        # the experts kept at max rounding, over every ep rank
        skipped = torch.zeros(experts.num_experts, dtype=torch.int64, device=experts.w13.device)
        for l in range(L):
            skipped[first + l] = int(l not in sums)
        run.state.all_reduce(skipped, over="ep", op=dist.ReduceOp.MAX)
        run.results.skipped[m] = skipped.nonzero().view(-1).tolist()
        if run.results.skipped[m] and run.state.rank == 0:
            logger().info("%s: GPTQ kept max rounding for experts %s (fewer than %d tokens, --gptq-min-tokens)",
                          m, run.results.skipped[m], run.min_tokens)

    def fake_quantize_inputs(self):
        """Every quantized module's input (and an FP8 KV cache's keys and values) through its
        scale, as the engines compute; returns the undo."""
        undo = []
        for m in self.dense:
            undo.append(fake_inputs(self._module(m), self.run.formats[m], self.scales.input_scale(m)))
        for m in self.experts:
            s = {}
            for kind in EXPERT_KINDS:  # the layer's largest, over every rank's experts
                amax = self.scales.expert_input_amax(m, kind).clone()
                self.run.state.all_reduce(amax, over="ep", op=dist.ReduceOp.MAX)
                s[kind] = self.scales.scale(m, amax)
            undo.append(fake_expert_inputs(self._module(m), self.run.formats[m], s["w13"], s["w2"]))
        for attn, (k_amax, v_amax) in self.kv.items():
            module = self._module(attn)
            ks, vs = fp8_scale(k_amax), fp8_scale(v_amax)
            module.kv_quant = lambda k, v, ks=ks, vs=vs: (fake_quant_fp8(k, ks), fake_quant_fp8(v, vs))
            undo.append(lambda module=module: setattr(module, "kv_quant", None))
        return lambda: [u() for u in undo]


def _add_units(sums: dict[int, tuple[HessianSum, HessianSum]], x_sorted: torch.Tensor, h_sorted: torch.Tensor,
               rows_per_unit_LU: torch.Tensor) -> None:
    """Each (local expert, work unit)'s rows, as `Experts.forward_units` computed them, into the
    expert's sums (those with enough tokens)."""
    counts = rows_per_unit_LU.tolist()
    start = 0
    for l, row in enumerate(counts):
        for n in row:
            if n and l in sums:
                sums[l][0].add(x_sorted[start:start + n])
                sums[l][1].add(h_sorted[start:start + n])
            start += n
