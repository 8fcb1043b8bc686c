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
    refuse_split_fusion(modules, quantized, recipe, where)
    if recipe.weight_format == "nvfp4":
        refuse_unblockable(layout, quantized, recipe, where)
    return quantized


def refuse_split_fusion(modules: dict, quantized: dict, recipe: Recipe, where: str) -> None:
    """A fused module is one weight to the engines: part quantized, part not, it cannot be loaded."""
    for module in quantized:
        parent, leaf = module.rsplit(".", 1)
        group = next((g for g in FUSED_SIBLINGS if leaf in g), ())
        plain = sorted(m for m in (f"{parent}.{x}" for x in group) if m in modules and m not in quantized)
        if plain:
            raise RecipeError(f"{where}: recipe {recipe.name!r} quantizes {module} but not {', '.join(plain)}; the "
                              f"engines load {'/'.join(sorted(group))} as one fused module: give them one format")


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
    for pattern, fmt in recipe.rules:
        if fmt == "none" or any(fnmatch.fnmatchcase(m, pattern) for m in modules):
            continue
        close = difflib.get_close_matches(pattern, modules, n=SUGGESTIONS, cutoff=0.0)
        hints.append(f"pattern {pattern!r} matches no module (closest: {', '.join(close)})")
    return ": " + "; ".join(hints) if hints else ""
