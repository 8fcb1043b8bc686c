"""Whether a recipe can quantize a model, decided from shapes alone: the one rule PTQ checks at its
start (and `--dry-run`), before a weight is read, and export checks again before it writes.

A recipe must quantize at least one module; Linears the engines load as one fused module
(eprt.quant.fusion) must be quantized all or none; and each module it quantizes must fit its
format: NVFP4 packs blocks of 16 consecutive elements along the input dim (eprt.quant.nvfp4),
so every weight of the module (both stacked tensors of a MoE layer's experts) needs an input dim
that is a multiple of 16. FP8 per-tensor quantizes any shape.
"""

from __future__ import annotations

import difflib
import fnmatch
import re

from eprt.errors import ConfigError
from eprt.layout import Layout, TensorSpec
from eprt.quant.fusion import FUSED_SIBLINGS
from eprt.quant.nvfp4 import BLOCK_SIZE
from eprt.quant.recipe import Recipe

SUGGESTIONS = 3  # close module names shown for a pattern that matches none


class RecipeError(ConfigError):
    """A recipe that cannot quantize this model as written."""


def quantized_modules(layout: Layout, recipe: Recipe, where: str) -> dict[str, TensorSpec]:
    """The modules `recipe` quantizes in `layout`, by name; refuses a recipe that quantizes none,
    or a module its format cannot quantize. `where` names the checkpoint in the refusal."""
    modules = layout.linear_modules()
    quantized = {m: spec for m, spec in modules.items() if recipe.format_of(m)}
    if not quantized:
        raise RecipeError(f"recipe {recipe.name!r} quantizes no module of {where}"
                          f"{unmatched_hint(recipe, list(modules))}; fix its patterns")
    refuse_mtp_rules(layout, modules, recipe, where)
    refuse_split_fusion(modules, quantized, recipe, where)
    refuse_unblockable(layout, {m: s for m, s in quantized.items() if recipe.format_of(m) == "nvfp4"}, recipe, where)
    return quantized


MTP_LAYER = re.compile(r"^model\\\.layers\\\.(\d+)\\\.")  # a passthrough regex of a layer carried through


def mtp_modules(layout: Layout, modules: dict) -> list[str]:
    """The Linear modules of the multi-token-prediction layers the layout carries through
    (DeepSeek-V3's `model.layers.N`, N >= num_hidden_layers): a decoder layer's modules under the
    MTP layer's index, plus its eh_proj and shared head."""
    layers = [int(m.group(1)) for p in layout.passthrough if (m := MTP_LAYER.match(p))]
    if not layers:
        return []
    last = min(layers) - 1
    in_layer = {m.split(f"layers.{last}.", 1)[1] for m in modules if f"layers.{last}." in m}
    return [f"model.layers.{n}.{leaf}" for n in layers for leaf in sorted(in_layer | {"eh_proj", "shared_head.head"})]


def refuse_mtp_rules(layout: Layout, modules: dict, recipe: Recipe, where: str) -> None:
    """The MTP layers are carried through unquantized: the layer-major engine can run them on the
    last layer's hidden states (LayerEngine.run_mtp), but convert carries their tensors under
    their Hugging Face names outside the layout, and export has no companions for them yet. A
    rule written for them alone, one that
    quantizes an MTP module and none of the model's own, is refused by name. A rule matching both
    leaves the MTP layers unquantized, excluded by name in the export."""
    for mtp in mtp_modules(layout, modules):
        rule = recipe.rule_of(mtp)
        if rule and rule.format != "none" and not any(fnmatch.fnmatchcase(m, rule.pattern) for m in modules):
            raise RecipeError(f"{where}: recipe {recipe.name!r} quantizes {mtp} ({{pattern: {rule.pattern!r}, format: "
                              f"{rule.format}}}), a multi-token-prediction layer; eprt cannot export MTP layers quantized yet "
                              "and writes them back unquantized: drop the rule or give it format none")


def refuse_split_fusion(modules: dict, quantized: dict, recipe: Recipe, where: str) -> None:
    """A fused module is one weight to the engines: part quantized, part not, or parts in two
    formats, it cannot be loaded."""
    for module in quantized:
        parent, leaf = module.rsplit(".", 1)
        group = next((g for g in FUSED_SIBLINGS if leaf in g), ())
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


def refuse_unblockable(layout: Layout, quantized: dict[str, TensorSpec], recipe: Recipe, where: str) -> None:
    """Every quantized weight whose input dim NVFP4 cannot split into blocks, refused at once."""
    bad = [(module, spec) for spec in layout.specs for module in [module_of(spec)]
           if module in quantized and spec.shape[-1] % BLOCK_SIZE]
    if not bad:
        return
    module, spec = bad[0]
    more = f" (and {len(bad) - 1} more: {', '.join(spec_name(s) for _, s in bad[1:4])}{'...' if len(bad) > 4 else ''})" \
        if len(bad) > 1 else ""
    raise RecipeError(f"{where}: {spec_name(spec)}: input dim {spec.shape[-1]} is not a multiple of {BLOCK_SIZE}; "
                      f"NVFP4 cannot quantize it{more}: exclude it in recipe {recipe.name!r} "
                      f"({{pattern: \"{module}\", format: none}} before the rule that matches it) or use fp8")


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
    for pattern, fmt, _ in recipe.rules:
        if fmt == "none" or any(fnmatch.fnmatchcase(m, pattern) for m in modules):
            continue
        close = difflib.get_close_matches(pattern, modules, n=SUGGESTIONS, cutoff=0.0)
        hints.append(f"pattern {pattern!r} matches no module (closest: {', '.join(close)})")
    return ": " + "; ".join(hints) if hints else ""
