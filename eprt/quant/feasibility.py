"""Whether a recipe can quantize a model, decided from shapes alone: the one rule PTQ checks at its
start (and `--dry-run`), before a weight is read, and export checks again before it writes.

A recipe must quantize at least one module; Linears the engines load as one fused module
(eprt.quant.fusion) must be quantized all or none; and each module it quantizes must fit its
format: a block format (NVFP4's blocks of 16 consecutive elements along the input dim) needs every
weight of the module (both stacked tensors of a MoE layer's experts) to have an input dim its
blocks fill (`WeightFormat.unfit_input_dim`). FP8 per-tensor quantizes any shape.
"""

from __future__ import annotations

import difflib
import re

from eprt.errors import ConfigError
from eprt.layout import Layout, TensorSpec, layer_of
from eprt.quant.formats import WEIGHT_FORMATS, weight_format
from eprt.quant.fusion import fused_members
from eprt.quant.recipe import Recipe, matches

SUGGESTIONS = 3  # close module names shown for a pattern that matches none


class RecipeError(ConfigError):
    """A recipe that cannot quantize this model as written."""


def quantized_modules(layout: Layout, recipe: Recipe, where: str) -> dict[str, TensorSpec]:
    """The modules `recipe` quantizes in `layout`, by name; refuses a recipe that quantizes none,
    or a module its format cannot quantize. `where` names the checkpoint in the refusal. The
    multi-token-prediction layers count only for a recipe that says `mtp: true` (`mtp_candidates`)."""
    if recipe.experts_storage is not None:
        raise RecipeError(
            f"recipe {recipe.name!r} says experts_storage, which is for a checkpoint eprt does not model; "
            f"{where} is of a family eprt models, whose own table says how it stores its experts: leave it out"
        )
    modules = {**layout.linear_modules(), **mtp_candidates(layout, recipe, where)}
    quantized = {m: spec for m, spec in modules.items() if recipe.format_of(m)}
    if not quantized:
        raise RecipeError(
            f"recipe {recipe.name!r} quantizes no module of {where}"
            f"{unmatched_hint(recipe, list(modules))}; fix its patterns"
        )
    refuse_split_fusion(modules, quantized, recipe, where)
    refuse_unimplemented_algorithms(quantized, recipe, where)
    refuse_unblockable((*layout.specs, *layout.mtp), quantized, recipe, where)
    if recipe.mtp:
        refuse_mtp_gaps(layout, quantized, recipe, where)
    return quantized


MTP_LAYER = re.compile(r"^model\\\.layers\\\.(\d+)\\\.")  # a passthrough regex of a layer carried through


def mtp_modules(layout: Layout, modules: dict) -> list[str]:
    """The Linear modules of the multi-token-prediction layers (DeepSeek-V3's `model.layers.N`,
    N >= num_hidden_layers): those of `layout.mtp` where eprt runs them, else, for layers it only
    carries through, a decoder layer's modules under the MTP layer's index plus its eh_proj and
    shared head."""
    if layout.mtp:
        return sorted({module_of(s) for s in layout.mtp if s.stacked or len(s.shape) == 2} - {None})
    layers = [int(m.group(1)) for p in layout.passthrough if (m := MTP_LAYER.match(p))]
    if not layers:
        return []
    last = min(layers) - 1
    in_layer = {m.split(f"layers.{last}.", 1)[1] for m in modules if f"layers.{last}." in m}
    return [f"model.layers.{n}.{leaf}" for n in layers for leaf in sorted(in_layer | {"eh_proj", "shared_head.head"})]


def mtp_candidates(layout: Layout, recipe: Recipe, where: str) -> dict[str, TensorSpec]:
    """The MTP modules `recipe` may quantize: none unless it says `mtp: true` (without it the MTP
    layers are carried through byte for byte, and a rule written for them alone, one that quantizes
    an MTP module and none of the model's own, is refused by name). Under `mtp: true`, the modules of
    `layout.mtp` a family allows (its eh_proj, own embedding and shared head stay unquantized);
    refused for a model whose MTP layers eprt carries through without running them (DeepSeek-V3.2's,
    with its indexer: their calibration needs their forward)."""
    modules = layout.linear_modules()
    carried = mtp_modules(layout, modules)
    if recipe.mtp:
        if carried and not layout.mtp:
            layers = sorted({".".join(m.split(".")[:3]) for m in carried})
            raise RecipeError(
                f"{where}: recipe {recipe.name!r} says mtp: true, but eprt does not run this model's "
                f"multi-token-prediction layers ({', '.join(layers)}; it runs DeepSeek-V3's, "
                "Kimi-K2's and GLM-4.5's) and carries them through unquantized: remove `mtp: true` "
                "from the recipe"
            )
        return layout.linear_modules(mtp=True)
    for mtp in carried:
        rule = recipe.rule_of(mtp)
        if rule and rule.format != "none" and not any(matches(m, rule.pattern) for m in modules):
            way_out = (
                "add `mtp: true` to the recipe to quantize the MTP layers by its rules, or drop the rule"
                if layout.mtp
                else "eprt carries this model's MTP layers through unquantized: drop the rule or give it format none"
            )
            raise RecipeError(
                f"{where}: recipe {recipe.name!r} quantizes {mtp} ({{pattern: {rule.pattern!r}, format: "
                f"{rule.format}}}), a multi-token-prediction layer, but does not say mtp: true; {way_out}"
            )
    return {}


def refuse_mtp_gaps(layout: Layout, quantized: dict, recipe: Recipe, where: str) -> None:
    """Under `mtp: true` each MTP layer quantizes a module: MTP layer k runs on layer k - 1's output,
    so calibrating one needs every one before it, and a layer the recipe leaves whole is a recipe
    that meant something else."""
    candidates = layout.linear_modules(mtp=True)
    for n in sorted({layer_of(s.name) for s in layout.mtp}):
        if not any(layer_of(m) == n for m in quantized):
            some = ", ".join(sorted(m for m in candidates if layer_of(m) == n)[:3])
            raise RecipeError(
                f"{where}: recipe {recipe.name!r} says mtp: true but quantizes no module of the "
                f"multi-token-prediction layer model.layers.{n}: make a rule match its modules "
                f"({some}, ...), or remove `mtp: true`"
            )


def refuse_split_fusion(modules: dict, quantized: dict, recipe: Recipe, where: str) -> None:
    """A fused module is one weight to the engines: part quantized, part not, or parts in two
    formats, it cannot be loaded."""
    for module in quantized:
        parent, leaf = module.rsplit(".", 1)
        group = fused_members(leaf)
        fmt = recipe.format_of(module)
        members = [m for m in (f"{parent}.{x}" for x in group) if m in modules]
        plain = sorted(m for m in members if m not in quantized)
        other = sorted(m for m in members if m in quantized and recipe.format_of(m) != fmt)
        fused = f"the engines load {'/'.join(sorted(group))} as one fused module: give them one format"
        if plain:
            raise RecipeError(f"{where}: recipe {recipe.name!r} quantizes {module} but not {', '.join(plain)}; {fused}")
        if other:
            said = ", ".join(f"{m} with {recipe.format_of(m)}" for m in other)
            raise RecipeError(f"{where}: recipe {recipe.name!r} quantizes {module} with {fmt} but {said}; {fused}")


def refuse_unimplemented_algorithms(quantized: dict, recipe: Recipe, where: str) -> None:
    """A format with nothing for `mse` to search or GPTQ to round by (FP8 block: its scales are each
    block's own amax, its inputs the engine's) runs `max` only: another algorithm is refused by name,
    not run as `max`."""
    for module in quantized:
        fmt, algorithm = weight_format(recipe.format_of(module)), recipe.algorithm_of(module)
        if recipe.rounding_of(module) not in fmt.algorithms:  # AWQ scales any format: its rounding decides
            raise RecipeError(
                f"{where}: recipe {recipe.name!r} quantizes {module} in {fmt.name} with algorithm "
                f"{algorithm}, which {fmt.name} does not implement (it runs {', '.join(fmt.algorithms)}: "
                f"its scales come from the weights alone); use --algorithm "
                f"{' or '.join(fmt.algorithms)} or another format for it"
            )


def refuse_unblockable(specs, quantized: dict[str, TensorSpec], recipe: Recipe, where: str) -> None:
    """Every quantized weight of `specs` whose input dim its format cannot split into blocks, refused
    at once (naming the first format that refuses one)."""
    bad = [
        (module, spec)
        for spec in specs
        for module in [module_of(spec)]
        if module in quantized and weight_format(recipe.format_of(module)).unfit_input_dim(spec.shape[-1])
    ]
    if not bad:
        return
    module, spec = bad[0]
    fmt = weight_format(recipe.format_of(module))
    fits = " or ".join(f.name for f in WEIGHT_FORMATS.values() if not f.unfit_input_dim(spec.shape[-1]))
    more = (
        f" (and {len(bad) - 1} more: {', '.join(spec_name(s) for _, s in bad[1:4])}{'...' if len(bad) > 4 else ''})"
        if len(bad) > 1
        else ""
    )
    raise RecipeError(
        f"{where}: {spec_name(spec)}: input dim {spec.shape[-1]} is not a multiple of "
        f"{fmt.group_size}; {fmt.quant_algo} cannot quantize it{more}: exclude it in recipe "
        f'{recipe.name!r} ({{pattern: "{module}", format: none}} before the rule that matches it) or use {fits}'
    )


def module_of(spec: TensorSpec) -> str | None:
    """The module a weight belongs to: `...experts` for a stacked tensor, else the name without `.weight`."""
    if spec.stacked:
        return spec.name.rsplit(".", 1)[0]
    return spec.name[: -len(".weight")] if spec.name.endswith(".weight") else None


def spec_name(spec: TensorSpec) -> str:
    return spec.name if spec.stacked else spec.name[: -len(".weight")]


def unmatched_hint(recipe: Recipe, modules: list[str]) -> str:
    """For each quantizing pattern that matches no module: the module names closest to it."""
    hints = []
    for pattern, fmt, *_ in recipe.rules:  # a rule's algorithm and parameters do not matter here
        if fmt == "none" or any(matches(m, pattern) for m in modules):
            continue
        close = difflib.get_close_matches(pattern, modules, n=SUGGESTIONS, cutoff=0.0)
        hints.append(f"pattern {pattern!r} matches no module (closest: {', '.join(close)})")
    return ": " + "; ".join(hints) if hints else ""
