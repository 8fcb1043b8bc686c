"""How the source encodings eprt reads of itself are found among a checkpoint's tensors: the `find`
functions of their registry entries (eprt.storage.source_decoders), which eprt.storage.encodings
registers beside their decoders:

- block FP8 (`fp8-block`: `M.weight` float8_e4m3fn beside `M.weight_scale_inv`, fp32 per block, or
  MXFP8's E8M0 exponents) and per-tensor FP8 (`fp8-tensor`), announced by `quant_method: fp8` with
  and without `weight_block_size`; fused experts P spell theirs `P`, `P_scale_inv` (`component_names`);
- DeepSeek-V4's FP8 and FP4 (`deepseek-fp8`, `deepseek-fp4`: `M.weight` float8_e4m3fn or int8 beside
  an E8M0 `M.scale`; eprt.storage.deepseek_encodings), announced by `quant_method: fp8` as its release does;
- OpenAI's MXFP4 (`mxfp4`: `P_blocks`, `P_scales`; eprt.storage.mxfp4_blocks) by `suffix_finder`;
- each compressed-tensors format eprt decodes (`compressed-tensors/<format>`), a module's weight
  under the config group that targets it (`group_of`, by compressed-tensors' own rule, `matches`).

An FP8 or DeepSeek-V4 scale beside an FP8 (or packed FP4) weight is known by its name and dtypes
whatever config.json says, so a config that does not announce FP8 is refused over it: loaded as
stored, the weight would be unscaled.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

import torch

from eprt.errors import CheckpointError
from eprt.storage.source_decoders import Components, SourceError

# An FP8 finder's question to the source's quantization (eprt.storage.encodings.SourceQuantization): the
# local names of the components of a weight its encoding stores, or None where the quantization is in
# another (per-tensor FP8, for the block FP8 entry); its decoder's, which the caller knows.
ComponentsOf = Callable[[object], tuple[str, ...] | None]
# A compressed-tensors finder's: a config group's scheme (its format resolved) and where the config is ->
# the components its compressor reads
GroupComponents = Callable[[dict, str], tuple[str, ...]]


def component_names(weight: str, components) -> dict[str, str]:
    """The Hugging Face name of each component of the encoded weight stored as `weight`: a module's
    `M.weight` has `M.<component>`; a fused parameter P (a name without `.weight`) has P itself
    and `P_<component>` for the others, `weight_` dropped (`P_scale_inv`), as transformers names them."""
    if weight.endswith(".weight"):
        module = weight[: -len(".weight")]
        return {c: f"{module}.{c}" for c in components}
    return {c: weight if c == "weight" else f"{weight}_{c.removeprefix('weight_')}" for c in components}


def matches(module: str, targets: list[str]) -> bool:
    """compressed-tensors' own rule for `ignore` and `targets` (its `match_name`): a `re:` entry
    matches where its regex matches at the start of the name (`re.match`, not a full match), any
    other entry where it equals the name; of the class targets, a compressed module is a torch
    Linear, which "Linear" names. Written here rather than imported, so that reading or writing
    a config does not import the library (and transformers with it)."""
    return any(
        t == "Linear" or (re.match(t[3:], module) is not None if t.startswith("re:") else t == module) for t in targets
    )


def fp8_finder(components_of: ComponentsOf):
    """The `find` of an FP8 encoding: every `M.weight_scale_inv` (or fused `P_scale_inv`) beside its
    float8_e4m3fn weight, where the config's FP8 is this encoding (`components_of`)."""

    def find(tensors: Mapping, quant) -> dict[str, Components]:
        out: dict[str, Components] = {}
        components = components_of(quant) if quant is not None else None
        for name in tensors:
            if not name.endswith("_scale_inv"):
                continue
            module, _, leaf = name.rpartition(".")
            weight = f"{module}.weight" if leaf == "weight_scale_inv" else name[: -len("_scale_inv")]
            if quant is None:
                raise SourceError(
                    name,
                    f"tensor {name!r} is an FP8 scale, but config.json declares no FP8 quantization_config "
                    "(quant_method fp8, with weight_block_size for block FP8)",
                )
            if weight not in tensors or tensors[weight].dtype != torch.float8_e4m3fn:
                raise SourceError(name, f"FP8 scale {name!r} has no float8_e4m3fn {weight!r} beside it")
            if components is None:  # the other FP8 entry's
                continue
            parts = component_names(weight, components)
            missing = [n for n in parts.values() if n not in tensors]
            if missing:
                raise SourceError(
                    name,
                    f"{weight!r} is FP8 with static activations ({quant.where}), but its {missing[0]!r} is "
                    "missing; every FP8 weight of such a checkpoint has one",
                )
            out[weight] = parts
        return out

    return find


def deepseek_finder(weight_dtype: torch.dtype):
    """The `find` of DeepSeek-V4's encoding of `weight_dtype` weights: each `M.weight` of that dtype
    beside an E8M0 `M.scale` (a `scale` beside any other weight is no encoding's)."""

    def find(tensors: Mapping, quant) -> dict[str, Components]:
        out: dict[str, Components] = {}
        for name, info in tensors.items():
            module, _, leaf = name.rpartition(".")
            weight = f"{module}.weight"
            if leaf != "scale" or weight not in tensors or tensors[weight].dtype != weight_dtype:
                continue
            if quant is None:
                raise SourceError(
                    name,
                    f"{weight!r} is stored {weight_dtype} with its scale {name!r}, but config.json declares no "
                    "FP8 quantization_config (quant_method fp8), as DeepSeek-V4's release does",
                )
            if info.dtype not in (torch.float8_e8m0fnu, torch.uint8):
                raise SourceError(name, f"{name!r} is {info.dtype}, not the E8M0 scale (float8_e8m0fnu) of {weight!r}")
            out[weight] = {"weight": weight, "scale": name}
        return out

    return find


# --- compressed-tensors -------------------------------------------------------------------------


def group_of(module: str, groups: dict[str, dict], where: str) -> str:
    """The config group whose scheme a compressed module follows: one that names it (exact or
    `re:`), else one that targets every Linear."""
    named = [
        g for g, d in groups.items() if any(t != "Linear" and matches(module, [t]) for t in d.get("targets") or [])
    ]
    found = named or [g for g, d in groups.items() if "Linear" in (d.get("targets") or [])]
    if not found:
        raise CheckpointError(
            f"{where} is compressed, but no config group of the quantization_config targets "
            f"{module}, so its scheme is unknown"
        )
    if any(groups[g] != groups[found[0]] for g in found[1:]):
        raise CheckpointError(
            f"{where}: config groups {found[0]} and {found[1]} both target {module} with different "
            "schemes; which one compressed it is ambiguous"
        )
    return found[0]


def compressed_modules(tensors: Mapping, quant, components_of: GroupComponents) -> dict[str, tuple[str, Components]]:
    """Every module stored compressed, by name: (its config group, its components, `components_of`
    the group's scheme); refuses one the config's ignore list excepts, one no group targets, and one
    missing a component."""
    groups = quant.groups()
    components = {g: components_of(d, quant.where) for g, d in groups.items()}
    markers = {c for names in components.values() for c in names} - {"weight"}
    out: dict[str, tuple[str, Components]] = {}
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        if leaf not in markers or module in out:
            continue
        ignored = next((i for i in quant.ignore if matches(module, [i])), None)
        if ignored is not None:
            raise SourceError(
                name,
                f"tensor {name!r} is compressed, but the quantization_config's ignore entry {ignored!r} says "
                f"{module} is not: the checkpoint and its config.json disagree; fix the ignore list or the weights",
            )
        try:
            g = group_of(module, groups, f"tensor {name!r}")
        except CheckpointError as e:
            raise SourceError(name, str(e)) from None
        missing = [c for c in components[g] if f"{module}.{c}" not in tensors]
        if missing:
            raise SourceError(
                name,
                f"{module} is compressed ({groups[g]['format']}, {g}) but tensor '{module}.{missing[0]}' is missing",
            )
        out[module] = (g, {c: f"{module}.{c}" for c in components[g]})
    return out


# The last scan's (tensors, quant, its modules): each format's entry asks for the same scan of one source in turn
_LAST_SCAN: list = []


def scanned(tensors: Mapping, quant, components_of: GroupComponents) -> dict[str, tuple[str, Components]]:
    """`compressed_modules`, scanned once for the entries of every format of one source."""
    if not (_LAST_SCAN and _LAST_SCAN[0] is tensors and _LAST_SCAN[1] is quant):
        _LAST_SCAN[:] = [tensors, quant, compressed_modules(tensors, quant, components_of)]
    return _LAST_SCAN[2]


def ct_finder(fmt: str, components_of: GroupComponents):
    """The `find` of compressed-tensors format `fmt`: the compressed modules whose group is in it
    (`components_of`: a group's components, from its scheme with its format resolved)."""

    def find(tensors: Mapping, quant) -> dict[str, Components]:
        if quant is None:
            return {}
        groups = quant.groups()
        return {
            f"{module}.weight": parts
            for module, (g, parts) in scanned(tensors, quant, components_of).items()
            if groups[g]["format"] == fmt
        }

    return find


def ct_group(weight: str, quant) -> str:
    module = weight[: -len(".weight")]
    return group_of(module, quant.groups(), f"tensor '{module}'")
