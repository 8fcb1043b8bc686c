"""The per-layer format search (`--auto-quantize BUDGET`): which format each module group gets, so
that the estimated loss is least under a budget of effective bits per active parameter.

A module group is what must share a format: the Linears an engine fuses (q/k/v, gate/up,
eprt.quant.fusion), a layer's routed experts, and every other quantizable Linear alone. Each group
takes one of the candidate formats (default NVFP4, FP8, unquantized) that fits all its weights;
MLA's kv_b_proj takes none that quantizes its inputs to 4 bits (eprt.quant.absorbed says why).

Bits are counted as the export stores them (`WeightFormat.modelopt_tensors`: NVFP4's 4-bit codes,
its E4M3 scale per 16 elements and fp32 per-tensor scales; FP8's codes and scales), an unquantized
weight as bf16, 16 bits. The budget is per ACTIVE parameter: a token runs top-k of a layer's E
routed experts, so they weigh top-k/E of their stored size, and the effective bits of a choice are
its active bits over the active parameters of every group.

The loss of a group in a candidate is measured in the calibration's layer-major pass
(eprt.quant.algorithms.search.passes): the squared error of the layer's output (the residual stream)
per calibration token, with that group alone fake-quantized in that candidate, over the RMS of the
output's tokens. On the calibration sequences, not the quality report's held-out ones, so that the
report's KL of the choice is measured on data the choice was not fitted to. The RMS to the power
one is between two readings of how an error reaches the head: relative to the stream where it is
made (the squared error over the squared RMS; over-protects the early layers, where the stream is
small) and as it is (the identity path of every later layer carries it unchanged; over-protects
the late layers). On the trained model of bench/auto_quantize.py, at the shipped mixed recipe's
bits (the errors then measured on the held-out sequences), the first's choice measured 2% more KL
than that recipe, the second's and this one's 3% less, and over a sweep of 4.8 to 8 bits this
one's was the least or within 4% of the least of the three (docs/quality.md, "Format search").
The estimate adds them up: small independent perturbations add their squared errors, and to first
order the KL of the output grows with them. One constant turns the sum into KL, measured in the
same pass: the quality report's KL (on its held-out sequences) with every group in its smallest
candidate over the sum of their errors (on the calibration ones); it scales every choice's
estimate alike, so the held-out data never changes the choice.

The choice (`SearchSpace.choose`) is exact up to a grid of the budget: a multiple-choice knapsack
solved by dynamic programming over the bits a group spends above its smallest candidate, each
rounded up to the grid, so the choice always meets the budget and a larger budget never gives a
larger estimated loss.

The search measures with max or mse statistics (`search_algorithm`): they do not depend on the
format, so the choice can come after the loop, and the search's statistics are the chosen
recipe's. GPTQ and AWQ work in each layer's format: with them the search measures with max, and
the chosen recipe is then calibrated again with the asked algorithm (eprt.quant.run.ptq).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from eprt.errors import ConfigError
from eprt.layout import EXPERT_LEAVES, Layout, layer_of
from eprt.quant.absorbed import ABSORBED, absorbed_in_4_bit_inputs
from eprt.quant.algorithms.registry import ROTATE, rotated
from eprt.quant.algorithms.search.budget import UNQUANTIZED_BITS
from eprt.quant.formats import weight_format
from eprt.quant.fusion import fused_members
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.recipe import FORMATS, Recipe, Rule, named_grid

# The algorithms whose statistics do not depend on the format, so the choice can come after the
# loop and keep the search's statistics; GPTQ and AWQ work in each layer's format during the loop.
# The rotation is the model's, whatever the formats: the search measures the rotated model.
SEARCHABLE_ALGORITHMS = ("max", "mse", ROTATE, f"{ROTATE}+mse")
# steps of the knapsack's grid over the bits between every group in its smallest candidate and every
# group in its largest (`SearchSpace.choose`)
GRID = 16384
# a budget met up to float rounding counts as met: one given as a choice's own effective bits admits that choice
ROUNDING = 1e-12
RECIPE_FILE = "auto_recipe.yaml"  # the chosen map, in the output


def parse_candidates(text: str) -> tuple[str, ...]:
    """`nvfp4,fp8,none`: the formats the search chooses from."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    bad = [n for n in names if n not in FORMATS]
    if bad or len(set(names)) != len(names):
        raise ConfigError(
            f"--auto-quantize-formats {text!r}: give distinct formats, comma-separated, of {', '.join(FORMATS)}"
        )
    if not set(names) - {"none"}:
        raise ConfigError(f"--auto-quantize-formats {text!r}: give at least one format besides none")
    return names


def search_algorithm(algorithm: str) -> str:
    """The algorithm the search measures its errors with, under --algorithm `algorithm`: itself
    where its statistics do not depend on the format, else max (the calibration of the choice
    then runs `algorithm`); a rotating algorithm's search measures the rotated model (`rotate`)."""
    if algorithm in SEARCHABLE_ALGORITHMS:
        return algorithm
    return ROTATE if rotated(algorithm) else SEARCHABLE_ALGORITHMS[0]


def linear_bits(fmt: str, out_dim: int, in_dim: int) -> int:
    """The bits one Linear of weight [out_dim, in_dim] takes in `fmt` as the export stores it."""
    if fmt == "none":
        return UNQUANTIZED_BITS * out_dim * in_dim
    return sum(
        math.prod(shape) * dtype.itemsize * 8
        for dtype, shape in weight_format(fmt).modelopt_tensors(out_dim, in_dim).values()
    )


def linear_weights(layout: Layout, module: str, top_k: int, num_experts: int) -> Iterator[tuple[int, int, int, float]]:
    """(Linears, out dim, in dim, the share of tokens each is active for) of `module`'s weights: a
    Linear, or each stacked projection of an experts module (each expert's row holding `per_row` Linears)."""
    specs = {s.name: s for s in layout.specs}
    stacked = [specs[f"{module}.{leaf}"] for leaf in EXPERT_LEAVES if f"{module}.{leaf}" in specs]
    for spec in stacked:
        E, rows, D = spec.shape
        yield (spec.per_row * E, rows // spec.per_row, D, top_k / num_experts)
    if not stacked:
        yield (1, *specs[module + ".weight"].shape, 1.0)


@dataclass(frozen=True)
class Group:
    """Modules that share a format; `params` and `bits` (candidate -> bits) per active parameter's weight."""

    name: str
    modules: tuple[str, ...]
    params: float
    bits: dict[str, float]  # only the candidates that fit every weight of the group


@dataclass(frozen=True)
class SearchSpace:
    groups: tuple[Group, ...]
    candidates: tuple[str, ...]

    @classmethod
    def of(cls, layout: Layout, candidates: tuple[str, ...], top_k: int, num_experts: int) -> SearchSpace:
        """The groups of `layout`'s decoder layers (the multi-token-prediction layers are left as they are)."""
        modules = layout.linear_modules()
        grouped: dict[tuple[str, ...], None] = {}
        for m in modules:
            parent, _, leaf = m.rpartition(".")
            siblings = fused_members(leaf) or (leaf,)
            grouped[tuple(f"{parent}.{x}" for x in sorted(siblings) if f"{parent}.{x}" in modules)] = None
        groups = []
        for members in grouped:
            # (Linears, out, in, active share) of every weight of the group
            weights = [w for m in members for w in linear_weights(layout, m, top_k, num_experts)]
            fits = [
                c
                for c in candidates
                if c == "none"
                or not (
                    any(weight_format(c).unfit_input_dim(i) for _, _, i, _ in weights)
                    or any(absorbed_in_4_bit_inputs(m, weight_format(c)) for m in members)
                )
            ]
            if not fits:
                why = f"input dim {weights[0][2]}"
                if members[0].endswith(ABSORBED):
                    why += "; vLLM absorbs it through an identity matrix, which 4-bit inputs would quantize"
                raise ConfigError(
                    f"--auto-quantize-formats {','.join(candidates)}: none of them fits {members[0]} ({why}); "
                    "add none or a per-tensor format such as fp8"
                )
            params = sum(n * o * i * s for n, o, i, s in weights)
            bits = {c: sum(n * linear_bits(c, o, i) * s for n, o, i, s in weights) for c in fits}
            groups.append(Group(_group_name(members), members, params, bits))
        return cls(tuple(groups), candidates)

    @property
    def targets(self) -> list[str]:
        """Every module some candidate quantizes: what the search's calibration observes."""
        return [m for g in self.groups if set(g.bits) - {"none"} for m in g.modules]

    @property
    def params(self) -> float:
        return sum(g.params for g in self.groups)

    def effective_bits(self, choice: dict[str, str]) -> float:
        """Bits per active parameter of `choice` (group name -> format)."""
        return sum(g.bits[choice[g.name]] for g in self.groups) / self.params

    def of_recipe(self, recipe: Recipe) -> dict[str, str]:
        """What `recipe` gives each group (its first module's format; a recipe keeps fused Linears together)."""
        return {g.name: recipe.format_of(g.modules[0]) or "none" for g in self.groups}

    def smallest(self) -> dict[str, str]:
        """Every group in its candidate of fewest bits."""
        return {g.name: min(g.bits, key=lambda c: (g.bits[c], self.candidates.index(c))) for g in self.groups}

    def check_budget(self, budget: float) -> None:
        least = self.effective_bits(self.smallest())
        if budget * (1 + ROUNDING) < least:
            raise ConfigError(
                f"--auto-quantize {budget:g}bits: no choice of {','.join(self.candidates)} meets it; the smallest "
                f"feasible budget is {math.ceil(least * 1000) / 1000:.3f}bits (every group in its smallest format)"
            )

    def choose(self, budget: float, losses: dict[tuple[str, str], float]) -> dict[str, str]:
        """The choice of least total loss (`losses[(group, candidate)]`, 0 where absent: unquantized)
        whose effective bits are at most `budget`; the same on every rank for the same losses.

        The knapsack runs on a grid, each candidate's bits above the group's smallest rounded up to
        its steps: a choice within `floor(spare / step)` steps meets the budget. Rounding up costs
        each group less than a step, so the table runs `len(groups)` steps further, and the choice is
        the one of the most steps whose exact bits meet the budget (one within the floor always
        does). The table's least loss does not grow with the steps, so neither does the choice's
        with the budget."""
        self.check_budget(budget)
        base = self.smallest()
        extra = [{c: b - g.bits[base[g.name]] for c, b in g.bits.items()} for g in self.groups]
        span = sum(max(e.values()) for e in extra)
        unit = span / GRID if span > 0 else 1.0
        spare = budget * (1 + ROUNDING) * self.params - sum(g.bits[base[g.name]] for g in self.groups)
        options = [[c for c in self.candidates if c in g.bits] for g in self.groups]
        costs = [[math.ceil(e[c] / unit) for c in o] for e, o in zip(extra, options)]
        capacity = min(max(int(spare / unit), 0) + len(self.groups), sum(max(c) for c in costs))
        within = min(max(int(spare / unit), 0), capacity)
        inf = torch.tensor(float("inf"), dtype=torch.float64)
        best = torch.zeros(capacity + 1, dtype=torch.float64)  # least loss within b steps, groups so far
        picks = []
        for g, o, cost in zip(self.groups, options, costs):
            rows = [
                torch.cat([inf.expand(min(k, capacity + 1)), best[: max(capacity + 1 - k, 0)]])
                + losses.get((g.name, c), 0.0)
                for c, k in zip(o, cost)
            ]
            best, pick = torch.stack(rows).min(0)
            picks.append(pick.to(torch.int8))

        def at(steps: int) -> dict[str, str]:
            choice = {}
            for i in reversed(range(len(self.groups))):
                j = int(picks[i][steps])
                choice[self.groups[i].name] = options[i][j]
                steps -= costs[i][j]
            return {g.name: choice[g.name] for g in self.groups}

        for steps in range(capacity, within - 1, -1):
            choice = at(steps)
            if self.effective_bits(choice) <= budget * (1 + ROUNDING):
                return choice
        raise AssertionError("unreachable: a choice within the floor's steps meets the budget")

    def loss(self, choice: dict[str, str], losses: dict[tuple[str, str], float]) -> float:
        return sum(losses.get((g.name, choice[g.name]), 0.0) for g in self.groups)

    def recipe(self, choice: dict[str, str], kv_cache: str | None, algorithm: str) -> Recipe:
        """`choice` as a recipe: one rule per module, everything else unquantized."""
        # a candidate is the format it names, on the grid it names whatever the source's (`Recipe.on_source`)
        rules = [
            Rule(m, choice[g.name], algorithm, (), named_grid(choice[g.name], True))
            for g in self.groups
            for m in g.modules
        ]
        return Recipe("auto_quantize", (*rules, Rule("*", "none", algorithm)), kv_cache)

    def recipe_yaml(self, choice: dict[str, str], kv_cache: str | None, budget: float, algorithm: str) -> str:
        """The recipe a later run reuses with `--recipe`; its rules name no algorithm, so --algorithm
        chooses it as for any recipe."""
        lines = [
            f"# Written by --auto-quantize {budget:g}bits (formats {','.join(self.candidates)}, --algorithm "
            f"{algorithm}): {self.effective_bits(choice):.4f} effective bits per active parameter.",
            "name: auto_quantize",
            "quantize:",
            *(f'  - {{pattern: "{m}", format: {rule_format(choice[g.name])}}}' for g in self.groups for m in g.modules),
            '  - {pattern: "*", format: none}',
            f"kv_cache: {kv_cache or 'null'}",
        ]
        return "\n".join(lines) + "\n"


def rule_format(fmt: str) -> str:
    """A chosen format as a written rule gives it: with its INT4 grid, so that the recipe reused on
    any source quantizes as the search measured (a rule without one takes the source's)."""
    grid = named_grid(fmt, True)
    return fmt if grid is None else f"{fmt}, grid: {grid}"


def _group_name(members: tuple[str, ...]) -> str:
    if len(members) == 1:
        return members[0]
    parent = members[0].rpartition(".")[0]
    return f"{parent}.{{{','.join(m.rpartition('.')[2] for m in members)}}}"


def search_summary(
    space: SearchSpace,
    budget: float,
    choice: dict[str, str],
    losses: dict[tuple[str, str], float],
    kl_per_error: float,
    calibration_kl: float,
    algorithm: str,
) -> dict:
    """The quality report's `auto_quantize` field (its measured KL added by the run that measures it);
    `algorithm`: the run's --algorithm, which calibrates the choice."""
    return {
        "budget_bits": budget,
        "effective_bits": space.effective_bits(choice),
        "candidates": list(space.candidates),
        "algorithms": {"search": search_algorithm(algorithm), "calibration": algorithm},
        "estimated_kl": kl_per_error * space.loss(choice, losses),
        "kl_per_error": kl_per_error,
        "smallest": {"effective_bits": space.effective_bits(space.smallest()), "measured_kl": calibration_kl},
        "map": [
            {
                "group": g.name,
                "format": choice[g.name],
                "errors": {c: losses.get((g.name, c), 0.0) for c in space.candidates if c in g.bits},
            }
            for g in space.groups
        ],
        "notes": [
            "errors: the squared error of the group's layer output per calibration token over the output's RMS, "
            "the group alone quantized in each format; estimated_kl: kl_per_error times the chosen errors' sum, "
            "kl_per_error measured with every group in its smallest format"
        ],
    }


@dataclass(frozen=True)
class SearchResult:
    """What the search hands the calibration of its choice: the report's field, the recipe's text,
    the data it read (eprt.quant.run.data.report_data's: the calibration's too), the base's pins
    as it read it (eprt.quant.run.fingerprint) and its pass's seconds; and under max or mse, its
    statistics (every module a candidate quantizes, the KV cache's with --kv-cache; reduced over
    the ranks), which the chosen recipe keeps (None: calibrate again)."""

    summary: dict
    recipe_yaml: str
    data: tuple
    base: dict
    seconds: float
    statistics: Calibrator | None = None

    def chosen_statistics(self, targets: list[str], kv: bool) -> Calibrator:
        """The search's statistics of the chosen recipe's `targets` (and the KV cache's, with
        `kv`), in the order its own calibration would record them: layer by layer (the search
        observed those layers' modules in its own order), each layer's in the order of `targets`."""
        found = self.statistics
        cal = Calibrator(None, targets, kv=kv, all_experts=found.all_experts)
        for m in sorted(targets, key=layer_of):
            if m in found.input_amax:
                cal.input_amax[m] = found.input_amax[m]
                continue
            cal.expert_amax[m], cal.expert_tokens[m] = found.expert_amax[m], found.expert_tokens[m]
            if m in found.expert_all_tokens:
                cal.expert_all_tokens[m] = found.expert_all_tokens[m]
        if kv:
            cal.kv_amax = dict(found.kv_amax)
        return cal
