"""The model-free export's plan, from the source's headers alone: every output tensor in order,
which Linears are quantized in which format (eprt.hf.streaming.selection), the shards they fill,
and the memory a worker holds.

The order: for a family eprt models, its table's (convert's plan, grouped as its checkpoint files
are, each routed expert's projections one by one), so the export is the modeled export's, byte
for byte; for any other, the source's own. Shards are cut from that order at `max_shard_bytes`,
as eprt-export cuts them, whatever the number of workers: each shard is a function of the plan
alone, so a worker's shards are the same bytes whichever worker writes them.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass, field

from eprt.errors import ConfigError
from eprt.hf.convert import file_for
from eprt.hf.expert_stacks import STACKED, STACKED_BIAS, hidden_size
from eprt.hf.export_quantized import carried, is_expert_weight, layer_prefix
from eprt.hf.quant_configs import QuantizedLinears
from eprt.hf.streaming.selection import (
    Linear,
    Stacks,
    ignored,
    mtp_layer,
    mtp_own,
    weight_linear,
)
from eprt.hf.streaming.source import StreamSource
from eprt.layout import Layout, layer_of
from eprt.quant.feasibility import quantized_modules
from eprt.quant.formats import WeightFormat, weight_format
from eprt.quant.fusion import siblings
from eprt.quant.recipe import Recipe


@dataclass(frozen=True)
class Carried:
    """A tensor written as the source holds it (decoded, where it stores it encoded)."""

    name: str
    source: str
    index: int | None = None  # one expert of a stacked source
    rows: tuple[int, int] | None = None  # its rows of that expert (gate or up of a fused gate_up)


@dataclass(frozen=True)
class Quantized:
    linear: Linear
    format: WeightFormat
    mse: bool  # its scales from the mse search


@dataclass
class StreamPlan:
    items: list  # Carried and Quantized, in output order
    groups: dict[tuple, list[Linear]]  # each scale group's Linears
    unquantized: set[str] = field(default_factory=set)  # Linear-like modules left unquantized
    unquantized_experts: set[str] = field(default_factory=set)  # routed-experts modules left whole
    passthrough: set[str] = field(default_factory=set)  # what the family's table carries unmodeled
    modeled: bool = False

    def quantized_linears(self, source_config: dict, recipe: Recipe) -> QuantizedLinears:
        quantized = [q for q in self.items if isinstance(q, Quantized)]
        return QuantizedLinears(
            source_config,
            {q.linear.module: q.format for q in quantized},
            {q.linear.name: q.format for q in quantized},
            frozenset(self.unquantized),
            frozenset(self.unquantized_experts),
            frozenset(self.passthrough),
            recipe.kv_cache,
        )


def plan_stream(src: StreamSource, recipe: Recipe, layout: Layout | None) -> StreamPlan:
    """The plan of exporting `src` under data-free `recipe`: by the family's `layout` where eprt models it."""
    plan = table_plan(src, recipe, layout) if layout is not None else pattern_plan(src, recipe)
    for q in plan.items:
        if isinstance(q, Quantized) and q.format.unfit_input_dim(q.linear.shape[1]):
            raise ConfigError(
                f"{src.dir}: {q.linear.name} has {q.linear.shape[1]} inputs, which {q.format.name}'s blocks of "
                f"{q.format.group_size} do not fill; leave it unquantized (the recipe's ignore list) or choose "
                "another format for it"
            )
    return plan


def _quantized(linear: Linear, recipe: Recipe) -> Quantized:
    return Quantized(
        linear, weight_format(recipe.format_of(linear.module)), recipe.algorithm_of(linear.module) == "mse"
    )


def pattern_plan(src: StreamSource, recipe: Recipe) -> StreamPlan:
    """Any checkpoint: its tensors in the source's order, quantized by name pattern."""
    text = src.config.get("text_config") if isinstance(src.config.get("text_config"), dict) else src.config
    num_layers = text.get("num_hidden_layers")
    num_layers = num_layers if isinstance(num_layers, int) else None
    shapes = {n: t.shape for n, t in src.tensors.items()}
    stacks = Stacks(shapes, hidden_size(src.config), recipe.experts_storage, src.dir)
    items: list = []
    plan = StreamPlan(items, {})

    def wanted(module: str | None, name: str) -> bool:
        mtp = mtp_layer(name, num_layers)
        return (
            module is not None
            and src.tensors[name].dtype.is_floating_point
            and not ignored(module, recipe)
            and not (mtp is not None and mtp_own(module))
            and recipe.format_of(module) is not None
        )

    # the experts modules whose stacks are quantized: their biases are written expert by expert beside them
    split = {
        m["experts"]
        for n, t in src.tensors.items()
        if (m := STACKED.fullmatch(n)) and len(t.shape) == 3 and wanted(m["experts"], n)
    }
    for name, t in src.tensors.items():
        mtp = mtp_layer(name, num_layers)
        if mtp is not None and not recipe.mtp:  # carried whole, as a modeled family's table carries it
            items.append(Carried(name, name))
            plan.passthrough.add(mtp)
            continue
        bias = STACKED_BIAS.fullmatch(name)
        if bias is not None and bias["experts"] in split and len(t.shape) == 2:
            pieces, spec = stacks.biases(name, t.shape)
            if spec.permuted:
                src.permuted[name] = spec
            items += [Carried(piece, name, e, rows) for piece, e, rows in pieces]
            continue
        stacked = STACKED.fullmatch(name)
        module = stacked["experts"] if stacked and len(t.shape) == 3 else None
        linear = weight_linear(name, t.shape) if module is None else None
        if module is None and linear is not None:
            module = linear.module
        if not wanted(module, name):
            items.append(Carried(name, name))
            if linear is not None:
                plan.unquantized.add(linear.name)
            elif module is not None:  # a stack of experts carried whole
                plan.unquantized.add(module)
                plan.unquantized_experts.add(module)
            continue
        if linear is not None:
            items.append(_quantized(linear, recipe))
            continue
        linears, spec = stacks.linears(name, t.shape)
        if spec.permuted:
            src.permuted[name] = spec
        items += [_quantized(x, recipe) for x in linears]
    plan.groups = scale_groups(items)
    return plan


def table_plan(src: StreamSource, recipe: Recipe, layout: Layout) -> StreamPlan:
    """A family eprt models: its table's order, names and quantized modules, as its export writes them."""
    quantized = quantized_modules(layout, recipe, src.dir)
    specs = {s.name: s for s in layout.specs}
    by_file: dict[str, list] = defaultdict(list)
    for p in src.planner.plan():
        by_file[file_for(p.spec.name, p.role)].append(p)
    items: list = []
    plan = StreamPlan(items, {}, modeled=True)
    mtp, mtp_layers = mtp_linears(layout, quantized, plan)
    passthrough = []
    for p in (p for ps in by_file.values() for p in ps):
        spec, original = p.spec, specs.get(p.spec.name, p.spec)
        if p.role == "passthrough":
            hf = spec.sources[0]
            if hf in mtp:  # an MTP layer's Linear the recipe quantizes (mtp: true), in its carried place
                items.append(_quantized(mtp[hf], recipe))
            else:
                items.append(Carried(hf, hf))
                passthrough.append(hf)
            continue
        if original.stacked:
            if p.fused and spec.permuted:  # each expert read [out, in], its pieces apart, then sliced as eprt's
                src.permuted[spec.sources[0]] = spec
            module, h = spec.name.rsplit(".", 1)[0], original.source_shape()[0]
            weights = is_expert_weight(original)  # else their biases, which stay as the source holds them
            for j, s in enumerate(original.sources):
                e, k = divmod(j, original.per_row)
                where = (spec.sources[0], e, (k * h, (k + 1) * h)) if p.fused else (s, None, None)
                if module in quantized and weights:
                    x = Linear(s[: -len(".weight")], module, *where, original.source_shape(), ("row", spec.name, e))
                    items.append(_quantized(x, recipe))
                else:
                    items.append(Carried(s, *where))
                    if weights:
                        plan.unquantized.add(s[: -len(".weight")])
            if module not in quantized:
                plan.unquantized_experts.add(module)
            continue
        hf, module = spec.sources[0], spec.name[: -len(".weight")]
        if module in quantized:
            x = Linear(hf[: -len(".weight")], module, hf, None, None, tuple(spec.shape), ("linear", module))
            items.append(_quantized(x, recipe))
        else:
            items.append(Carried(hf, hf))
            if spec.name.endswith(".weight") and len(spec.shape) == 2:
                plan.unquantized.add(hf[: -len(".weight")])
    linears = {q.linear.name for q in items if isinstance(q, Quantized)}
    plan.passthrough = {
        layer_prefix(n) if layer_of(n) is not None else carried(n, linears)
        for n in passthrough
        if layer_prefix(n) not in mtp_layers
    }
    plan.groups = scale_groups(items)
    return plan


def mtp_linears(layout: Layout, quantized: dict, plan: StreamPlan) -> tuple[dict[str, Linear], set[str]]:
    """The Linears of the multi-token-prediction layers `quantized` holds a module of (a recipe with
    `mtp: true`), by their source weights, and those layers: modeled as the decoder's layers are,
    their other Linears counted unquantized in `plan` (convert carries the layers through under
    their Hugging Face names, each routed expert apart; eprt.layout.Layout.mtp)."""
    layers = {layer_prefix(m) for m in quantized} & {layer_prefix(s.name) for s in layout.mtp}
    out: dict[str, Linear] = {}
    for spec in (s for s in layout.mtp if layer_prefix(s.name) in layers):
        if spec.stacked:
            module = spec.name.rsplit(".", 1)[0]
            if module not in quantized:
                plan.unquantized.update(s[: -len(".weight")] for s in spec.sources)
                plan.unquantized_experts.add(module)
                continue
            for j, s in enumerate(spec.sources):
                group = ("row", spec.name, j // spec.per_row)
                out[s] = Linear(s[: -len(".weight")], module, s, None, None, spec.source_shape(), group)
        elif spec.name.endswith(".weight") and len(spec.shape) == 2:
            module = spec.name[: -len(".weight")]
            if module in quantized:
                out[spec.sources[0]] = Linear(
                    module, module, spec.sources[0], None, None, tuple(spec.shape), ("linear", module)
                )
            else:
                plan.unquantized.add(module)
    return out, layers


def scale_groups(items: list) -> dict[tuple, list[Linear]]:
    """Each quantized Linear's group of those sharing its per-tensor weight scale, where its format
    has one: a routed expert's fused projections (a row of its family's first stacked projection), and the dense Linears
    the engines fuse (eprt.quant.fusion); rewritten into each Linear's `group`."""
    quantized = [q for q in items if isinstance(q, Quantized)]
    by_module = {q.linear.module: q for q in quantized if q.linear.group[0] == "linear"}
    groups: dict[tuple, list[Linear]] = defaultdict(list)
    for i, q in enumerate(items):
        if not isinstance(q, Quantized):
            continue
        x = q.linear
        if x.group[0] == "linear":  # a dense Linear: its fused siblings
            members = siblings(x.module, by_module, q.format)
            x = dataclasses.replace(x, group=("linear", members[0]))
            items[i] = Quantized(x, q.format, q.mse)
        groups[x.group].append(x)
    return dict(groups)
