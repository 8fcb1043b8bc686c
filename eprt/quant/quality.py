"""The quality report of a PTQ run: how far the quantized model is from the unquantized one on
held-out sequences, computed inside the layer-major calibration (eprt.quant.loop.engine).

The engine runs two streams of the held-out sequences through each layer once the layer's
calibration is done and its amax reduced over the ranks (so its scales are the export's): the
reference stream through the layer as it is, then the quantized stream through the same layer
fake-quantized in place with the export's scales and numerics (eprt.quant.preview.fake_quantize:
weights, activations and the FP8 KV cache; each module's algorithm: max's or mse's scales, and
where GPTQ ran its weights, the codes the export writes), routed experts through the same
canonical work units as calibration. This module holds what the report measures:

- per layer, the relative error ||y_q - y_ref|| / ||y_ref|| of the layer's output (accumulated
  through the layers: each stream runs on its own output of the layer before), and the quantized
  modules and experts that contribute most: each one's relative output error on the quantized
  stream's input (the module with its original against its fake-quantized weights and input),
  ranked by that error squared times the share of the tokens the module sees, so an expert a
  handful of tokens reach does not top the list on a few rows;
- after the final norm and the head: per token KL(p_ref || p_q), its mean and 99th percentile,
  top-1 agreement, and the perplexity (next-token NLL) of both streams.

Every number is summed per held-out sequence (a dense module's, per call: one sequence's tokens)
or per expert work unit, filed at its global index, summed over the ranks (adding zeros is
exact) and then in index order, so the report is the same bytes at every layout.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import json
import math
import re
import threading
from collections.abc import Iterator
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from eprt.kernels import unit_mlp
from eprt.kernels.cpu_workers import for_each
from eprt.models.layers import linear
from eprt.models.moe import Experts
from eprt.models.taps import tapped
from eprt.parallel import ParallelState
from eprt.progress import logger

TOP = 5  # modules or experts listed per layer


class ModuleErrors:
    """Sums of squared output error, squared reference output and rows of the quantized stream
    through one layer: per call of each dense quantized module, filed under the sequence it came
    from (the engine runs the sequences' dense parts side by side, each on one thread, and says
    which one a thread runs: `enter`), and per routed expert and work unit of this rank's experts."""

    def __init__(self, num_units: int):
        self.num_units = num_units
        # module -> local sequence -> fp64 [err, ref, rows] per call, in the sequence's call order
        self.dense: dict[str, dict[int, list[torch.Tensor]]] = {}
        self.experts: dict[str, tuple[Experts, torch.Tensor]] = {}  # module -> (experts, fp64 [3, count, units])
        self.first_unit = 0  # the global index of the running step's first work unit
        self.thread = threading.local()  # .sequence: the local sequence this thread runs

    def enter(self, local_sequence: int) -> None:
        """The calls this thread makes next come from `local_sequence`."""
        self.thread.sequence = local_sequence


def _sums(d_R: torch.Tensor, ref_R: torch.Tensor) -> torch.Tensor:
    """[err, ref, rows] of rows' squared errors and squared reference norms."""
    return torch.stack(
        [d_R.sum(), ref_R.sum(), torch.tensor(float(d_R.numel()), dtype=torch.float64, device=d_R.device)]
    )


def _row_sums(y: torch.Tensor, y_ref: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: the squared error and the squared reference norm, in fp64 (worked in place on
    two fp64 copies: fresh temporaries of every step cost more than the arithmetic)."""
    y = y.reshape(-1, y.shape[-1]).to(torch.float64, copy=True)
    y_ref = y_ref.reshape(-1, y_ref.shape[-1]).to(torch.float64, copy=True)
    return y.sub_(y_ref).square_().sum(-1), y_ref.square_().sum(-1)


def filed_over_ranks(state: ParallelState, shape, mine: list[tuple[int, int]], values: torch.Tensor) -> torch.Tensor:
    """`values` [local sequences, ...] filed at their global indices (`mine`: this rank's (global,
    local) sequences) and summed over the world: every other rank adds zeros, so the sum is exact."""
    out = torch.zeros(shape, dtype=torch.float64, device=state.device)
    if mine:
        out[torch.tensor([s for s, _ in mine], device=out.device)] = values.double()
    return state.all_reduce(out, over="dp", op=dist.ReduceOp.SUM)


class Probes:
    """The original weights of one layer's quantized modules, kept before the layer is quantized
    in place; while `measuring`, each module's output on every call of the quantized stream is
    measured against the original's on the same input, into `errors`."""

    def __init__(self, layer, prefix: str, targets: list[str], num_units: int):
        self.errors = ModuleErrors(num_units)
        self.dense: list[tuple[str, nn.Module, torch.Tensor]] = []  # (name, Linear, its original weight)
        self.experts: list[tuple[Experts, Callable]] = []  # (experts, its units_output tap)
        for m in targets:
            if not m.startswith(prefix):
                continue
            module = layer.get_submodule(m[len(prefix) :])
            if isinstance(module, Experts):
                self.experts.append((module, _expert_probe(m, module, self.errors)))
            else:
                self.errors.dense.setdefault(m, {})
                self.dense.append((m, module, module.weight.detach().clone()))

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        errors = self.errors
        with contextlib.ExitStack() as taps:
            for m, module, weight in self.dense:
                calls = errors.dense[m]
                seen = threading.local()  # the input of the call this thread is in

                # ahead of the fake quantization's input hook: it sees the input as the module receives it
                def keep_input(_module, args, seen=seen):
                    seen.x = args[0]

                def measure(module, _args, y, seen=seen, weight=weight, calls=calls):
                    x, seen.x = seen.x, None  # not held past its call
                    sums = _sums(*_row_sums(y, linear(x, weight, module.bias)))
                    calls.setdefault(errors.thread.sequence, []).append(sums)

                taps.callback(module.register_forward_pre_hook(keep_input, prepend=True).remove)
                taps.callback(module.register_forward_hook(measure).remove)
            for experts, probe in self.experts:
                taps.enter_context(tapped(experts, units_output=probe))
            yield


def _expert_probe(name: str, experts: Experts, errors: ModuleErrors) -> Callable:
    """The `units_output` tap that files each (expert, work unit)'s error against the experts' original weights."""
    w_in, w_out = experts.w_in.detach().clone(), experts.w_out.detach().clone()
    biases = {"b_in": experts.b_in, "b_out": experts.b_out}  # left as they are by quantization
    sums = torch.zeros(3, experts.count, errors.num_units, dtype=torch.float64, device=w_in.device)
    errors.experts[name] = (experts, sums)

    def probe(x_sorted, rows_per_unit_LU, y):
        U = rows_per_unit_LU.shape[1]
        counts = rows_per_unit_LU.reshape(-1).tolist()
        starts = list(itertools.accumulate(counts, initial=0))
        # the reference rows a part of the experts at a time: a unit's result depends only on its
        # rows and its expert's weights, so the bits are the same, and the step holds one part's
        # reference activation and output, not the whole step's
        for e0, e1 in expert_parts(rows_per_unit_LU.sum(1).tolist(), REFERENCE_PARTS):
            first, last = starts[e0 * U], starts[e1 * U]
            part = {k: None if b is None else b[e0:e1] for k, b in biases.items()}
            _, y_ref = unit_mlp(
                x_sorted[first:last],
                w_in[e0:e1],
                w_out[e0:e1],
                experts.act,
                rows_per_unit_LU[e0:e1],
                gated=experts.pieces.gated,
                **part,
            )

            # one sum per (expert, unit) over the unit's own rows: the same bits wherever it ran, on
            # whichever worker; in fp64 a unit at a time, so that the widened copies are a unit's
            def unit(j: int, _, first=first, y_ref=y_ref) -> None:
                a, b = starts[j], starts[j + 1]
                sums[:, j // U, errors.first_unit + j % U] = _sums(*_row_sums(y[a:b], y_ref[a - first : b - first]))

            units = [j for j in range(e0 * U, e1 * U) if counts[j]]
            for_each(units, lambda: None, unit, y.device)
            del unit, y_ref  # the part's reference rows go before the next part's are made

    return probe


# the probes' reference rows of a step are computed in about this many parts (eprt.quant.run.planner prices one)
REFERENCE_PARTS = 8


def expert_parts(rows_E: list[int], parts: int) -> list[tuple[int, int]]:
    """Consecutive runs [e0, e1) of experts with rows, each closed once its rows reach 1/`parts` of
    them all: a run holds fewer rows than that share plus one expert's."""
    share = max(1, math.ceil(sum(rows_E) / parts))
    out, e0, held = [], 0, 0
    for e, rows in enumerate(rows_E):
        held += rows
        if held >= share:
            out.append((e0, e + 1))
            e0, held = e + 1, 0
    if held:
        out.append((e0, len(rows_E)))
    return out


class QualityReport:
    """The report's state on one rank: its eval ids (the global [n, T] ids), what each finished
    layer measured, and the head's per-token numbers. Every rank calls every method alike: they
    reduce over the ranks."""

    def __init__(
        self,
        state: ParallelState,
        ck,
        recipe,
        targets: list[str],
        eval_ids: torch.Tensor,
        source: str,
        on_weight: Callable[[str, torch.Tensor], None] | None = None,
    ):
        self.state, self.ck, self.recipe, self.targets = state, ck, recipe, targets
        self.eval_ids, self.source, self.on_weight = eval_ids, source, on_weight
        self.layers: list[dict] = []
        self.result: dict | None = None

    @property
    def tokens(self) -> int:
        return self.eval_ids.numel()

    def probes(self, layer, prefix: str, num_units: int) -> Probes:
        """One layer's probes, made before the layer is quantized in place as the export will
        (eprt.quant.preview.fake_quantize, with this report's `on_weight`); their `errors`'
        `first_unit` is set each step."""
        return Probes(layer, prefix, self.targets, num_units)

    def _global(self, shape, mine: list[tuple[int, int]], values: torch.Tensor) -> torch.Tensor:
        return filed_over_ranks(self.state, shape, mine, values)

    def finish_layer(
        self,
        i: int,
        prefix: str,
        mine: list[tuple[int, int]],
        y_ref: torch.Tensor,
        y_q: torch.Tensor,
        errors: ModuleErrors,
        router_flips: torch.Tensor | None = None,
    ) -> None:
        """File layer i's numbers: its output's relative error over every held-out sequence
        (`mine`: this rank's (global, local) sequences; y_*: their hidden states after the layer)
        and the top contributors; with AWQ, `router_flips`: the router's top-k choices its folds
        changed and all, over every rank."""
        n = self.eval_ids.shape[0]
        local = [li for _, li in mine]
        err = (y_q[local].double() - y_ref[local].double()).square().flatten(1).sum(1)
        ref = y_ref[local].double().square().flatten(1).sum(1)
        err, ref = self._global(n, mine, err).sum(), self._global(n, mine, ref).sum()
        modules = []  # (name, relative error, token share)
        for name, calls in errors.dense.items():
            # each sequence makes the same calls: [sequences, calls per sequence, 3]
            per_seq = (
                torch.stack([torch.stack(calls[li]) for li in local]).sum(1)
                if calls
                else torch.zeros(len(mine), 3, device=self.state.device)
            )
            modules.append((name, *_relative(self._global((n, 3), mine, per_seq).sum(0))))
        E = self.ck.config.num_experts
        expert_errors = {}  # experts module -> each expert's relative error (None: no held-out token reached it)
        for name, (experts, sums) in errors.experts.items():
            full = torch.zeros(3, E, errors.num_units, dtype=torch.float64, device=sums.device)
            full[:, experts.first : experts.first + experts.count] = sums
            # each (expert, unit) was computed on one rank: the others add zeros
            full = self.state.all_reduce(full, over="dp", op=dist.ReduceOp.SUM).sum(-1)
            modules += [(f"{name}.{e}", *_relative(full[:, e])) for e in range(E) if full[2, e] > 0]
            expert_errors[name] = [_relative(full[:, e])[0] if full[2, e] > 0 else None for e in range(E)]
        ranked = sorted(modules, key=lambda m: (-(m[1] ** 2) * m[2] / self.tokens, m[0]))
        self.layers.append(
            {
                "layer": i,
                "relative_error": _ratio(err, ref),
                "top": [
                    {"module": name, "relative_error": rel, "token_share": rows / self.tokens}
                    for name, rel, rows in ranked[:TOP]
                ],
                **({"expert_errors": expert_errors} if expert_errors else {}),
            }
        )
        if router_flips is not None:
            self.layers[-1]["router_flips"] = {"changed": int(router_flips[0]), "choices": int(router_flips[1])}

    def finish(
        self, mine: list[tuple[int, int]], logits_of: Callable[[int], tuple[torch.Tensor, torch.Tensor]]
    ) -> dict:
        """The whole report, from each held-out sequence's logits `logits_of(local index)` ->
        (reference [T, V], quantized [T, V])."""
        n, T = self.eval_ids.shape
        kl, agree = torch.zeros(len(mine), T), torch.zeros(len(mine), T)
        nll = torch.zeros(2, len(mine), max(T - 1, 0))
        for j, (s, li) in enumerate(mine):
            logp = [torch.log_softmax(x.float(), dim=-1) for x in logits_of(li)]
            kl[j] = (logp[0].exp() * (logp[0] - logp[1])).sum(-1).cpu()
            agree[j] = (logp[0].argmax(-1) == logp[1].argmax(-1)).cpu().float()
            nxt = self.eval_ids[s, 1:].to(logp[0].device)[:, None]
            for k in range(2):
                nll[k, j] = -logp[k][:-1].gather(-1, nxt)[:, 0].cpu()
        kl = self._global((n, T), mine, kl.to(self.state.device)).flatten()
        agree = self._global((n, T), mine, agree.to(self.state.device))
        nll_ref, nll_q = (self._global((n, T - 1), mine, nll[k].to(self.state.device)) for k in range(2))
        self.result = {
            "eval": {"sequences": n, "seq_len": T, "tokens": n * T, "data": self.source},
            "kl_mean": kl.mean().item(),
            "kl_p99": torch.quantile(kl, 0.99).item(),
            "top1_agreement": agree.mean().item(),
            "perplexity": {"unquantized": math.exp(nll_ref.mean().item()), "quantized": math.exp(nll_q.mean().item())},
            "layers": self.layers,
            **self._router_flips(),
            "notes": [
                "KL(unquantized || quantized) per token, natural log; relative errors are "
                "||y_q - y_ref|| / ||y_ref||, a layer's accumulated through the layers before it, "
                "a module's on the quantized stream's own input",
                "multi-token-prediction layers are calibrated but not in the report",
            ],
        }
        return self.result

    def _router_flips(self) -> dict:
        """With AWQ, `router_flips`: the share of every MoE layer's top-k choices its folds changed."""
        counted = [x["router_flips"] for x in self.layers if "router_flips" in x]
        if not counted:
            return {}
        return {"router_flips": sum(c["changed"] for c in counted) / max(sum(c["choices"] for c in counted), 1)}

    def describe_run(self, calibration: dict, experts: list[dict], preview: dict | None) -> None:
        """Add to the finished report what its page shows beside the numbers (eprt.report): the
        recipe and the format of each module group, the data calibrated on, the calibration tokens
        of every routed expert and what was done for those that starved, the preview's texts, and
        the held-out ids' digest (reports on the same digest compare on the same data). Added after
        the numbers, so the keys above keep their bytes."""
        groups: dict[tuple, int] = {}  # (module name with its layer index left out, format, algorithm) -> modules
        for m in self.targets:
            key = (re.sub(r"\.layers\.\d+\.", ".layers.*.", m), self.recipe.format_of(m), self.recipe.algorithm_of(m))
            groups[key] = groups.get(key, 0) + 1
        self.result.update(
            {
                "recipe": self.recipe.to_json(),
                "groups": [{"group": g, "format": f, "algorithm": a, "modules": n} for (g, f, a), n in groups.items()],
                "calibration": calibration,
                "experts": experts,
                "preview": preview,
                "eval_ids_sha256": hashlib.sha256(self.eval_ids.cpu().numpy().tobytes()).hexdigest(),
            }
        )

    # --- saved at each layer boundary, for --resume ---------------------------------------------
    def saved(self) -> str:
        return json.dumps(self.layers)

    def restore(self, saved: str) -> None:
        self.layers = json.loads(saved)

    def log(self) -> None:
        """Rank 0 prints the report, compactly."""
        if self.state.rank != 0 or self.result is None:
            return
        r, log = self.result, logger()
        ppl = r["perplexity"]
        log.info(
            "quality on %d held-out tokens: KL mean %.4g, p99 %.4g; top-1 agreement %.2f%%; perplexity %.4g -> %.4g",
            r["eval"]["tokens"],
            r["kl_mean"],
            r["kl_p99"],
            100 * r["top1_agreement"],
            ppl["unquantized"],
            ppl["quantized"],
        )
        if "router_flips" in r:
            log.info("  AWQ's folds changed %.3f%% of the routers' top-k choices", 100 * r["router_flips"])
        for layer in r["layers"]:
            top = ", ".join(f"{t['module'].rsplit('layers.', 1)[-1]} {t['relative_error']:.3g}" for t in layer["top"])
            log.info("  layer %d: relative error %.3g; most: %s", layer["layer"], layer["relative_error"], top or "-")


def _relative(sums: torch.Tensor) -> tuple[float, float]:
    """(relative error, rows) from [err, ref, rows] sums."""
    return _ratio(sums[0], sums[1]), sums[2].item()


def _ratio(err: torch.Tensor, ref: torch.Tensor) -> float:
    return math.sqrt(err.item() / ref.item()) if ref.item() > 0 else (0.0 if err.item() == 0 else math.inf)
