"""Which weights of a Hugging Face source are stored encoded, and how: block or per-tensor FP8
(`M.weight_scale_inv`), DeepSeek-V4's FP8 and FP4 with E8M0 scales (`M.scale`), GPT-OSS's MXFP4
(`P_blocks`, `P_scales`), compressed-tensors' groups, and the encodings a family registers
(eprt.storage.source_decoders); each found by its tensors' names and dtypes and checked against the
source's quantization_config, which must be true of the weights. Convert and the model-free export
plan from what this finds."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eprt.errors import CheckpointError
from eprt.hf.check_modelopt import ROUTED_EXPERT
from eprt.hf.source import HFSource
from eprt.storage import encodings, source_decoders
from eprt.storage.mxfp4_blocks import MXFP4_BLOCKS, MxFp4Blocks

FP8_SCHEME = "fp8"  # the manifest's name for a block-FP8 source's quantization_config


@dataclass(frozen=True)
class Encoded:
    """The source tensors of one encoded weight."""

    encoding: str
    scheme: str  # the quantization_config group (compressed-tensors), else its quant_method (FP8_SCHEME, ...)
    components: dict[str, str]  # local name (weight_packed, ...) -> Hugging Face name
    weight: str  # the Hugging Face name of the weight they decode to (`M.weight`, or a fused `P`)


def source_module(hf_weight: str) -> str | None:
    """The module a source weight belongs to (its name without `.weight`); None for any other tensor."""
    return hf_weight[: -len(".weight")] if hf_weight.endswith(".weight") else None


def encoded_modules(src: HFSource, quant: encodings.SourceQuantization | None) -> dict[str, Encoded]:
    """Every module whose weight the source stores encoded, by module name; refuses encoded
    tensors that its quantization_config does not account for."""
    out: dict[str, Encoded] = {}
    names = src.tensors
    for name, (f, _) in names.items():
        if not name.endswith("_scale_inv"):
            continue
        # a module's `M.weight_scale_inv`, or a fused parameter's `P_scale_inv` (transformers' spelling)
        module, _, leaf = name.rpartition(".")
        weight = f"{module}.weight" if leaf == "weight_scale_inv" else name[: -len("_scale_inv")]
        if quant is None or quant.method != "fp8":
            raise CheckpointError(
                f"{f.path}: tensor {name!r} is an FP8 scale, but config.json declares no FP8 "
                "quantization_config (quant_method fp8, with weight_block_size for block FP8)"
            )
        if weight not in names or names[weight][1].dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{f.path}: FP8 scale {name!r} has no float8_e4m3fn {weight!r} beside it")
        encoding = encodings.fp8_encoding(quant)
        parts = encodings.component_names(weight, encodings.decoder(encoding, quant.config, quant.where).components)
        missing = [n for n in parts.values() if n not in names]
        if missing:
            raise CheckpointError(
                f"{f.path}: {weight!r} is FP8 with static activations ({quant.where}), but its "
                f"{missing[0]!r} is missing; every FP8 weight of such a checkpoint has one"
            )
        key = weight[: -len(".weight")] if leaf == "weight_scale_inv" else weight
        out[key] = Encoded(encoding, FP8_SCHEME, parts, weight)
    out.update(deepseek_scaled(src, quant))
    if quant is None:
        return out
    if quant.method == MXFP4_BLOCKS:
        return mxfp4_blocks(src, out)
    # the encodings a family registers (eprt.storage.source_decoders), found by their names
    infos = {n: info for n, (_, info) in names.items()}
    for weight, (encoding, parts) in source_decoders.find_encoded(infos, quant.method, quant.config, src.dir).items():
        key = source_module(weight) or weight
        if key in out:
            raise CheckpointError(
                f"{src.dir}: {weight!r} is stored both as {out[key].encoding} and as {encoding}; "
                "the checkpoint's names are ambiguous"
            )
        out[key] = Encoded(encoding, quant.method, parts, weight)
    if quant.method != encodings.CT:
        return refuse_false_claims(src, out, quant)
    groups = quant.groups()
    decoders = {g: encodings.decoder(encodings.CT_PREFIX + d["format"], d, quant.where) for g, d in groups.items()}
    markers = {c for d in decoders.values() for c in d.components} - {"weight"}
    for name, (f, _) in names.items():
        module, _, leaf = name.rpartition(".")
        if leaf not in markers or module in out:
            continue
        ignored = next((i for i in quant.ignore if encodings.matches(module, [i])), None)
        if ignored is not None:
            raise CheckpointError(
                f"{f.path}: tensor {name!r} is compressed, but the quantization_config's ignore "
                f"entry {ignored!r} says {module} is not: the checkpoint and its config.json "
                "disagree; fix the ignore list or the weights"
            )
        g = group_of(module, groups, f"{f.path}: tensor {name!r}")
        missing = [c for c in decoders[g].components if f"{module}.{c}" not in names]
        if missing:
            raise CheckpointError(
                f"{f.path}: {module} is compressed ({groups[g]['format']}, {g}) but tensor "
                f"'{module}.{missing[0]}' is missing"
            )
        out[module] = Encoded(
            encodings.CT_PREFIX + groups[g]["format"],
            g,
            {c: f"{module}.{c}" for c in decoders[g].components},
            f"{module}.weight",
        )
    return refuse_false_claims(src, out, quant)


def mxfp4_blocks(src: HFSource, out: dict[str, Encoded]) -> dict[str, Encoded]:
    """`out` with every weight P stored in OpenAI's MXFP4 (`P_blocks` beside `P_scales`), by P."""
    names = src.tensors
    for name, (f, _) in names.items():
        if not name.endswith("_blocks"):
            continue
        weight = name[: -len("_blocks")]
        parts = encodings.component_names(weight, MxFp4Blocks.components)
        if parts["scales"] not in names:
            raise CheckpointError(f"{f.path}: MXFP4 tensor {name!r} has no {parts['scales']!r} beside it")
        out[weight] = Encoded(MXFP4_BLOCKS, MXFP4_BLOCKS, parts, weight)
    return out


# DeepSeek-V4's encodings by the dtype of the weight beside a `M.scale` (eprt.storage.deepseek_encodings)
DEEPSEEK_WEIGHTS = {torch.float8_e4m3fn: encodings.DEEPSEEK_FP8, torch.int8: encodings.DEEPSEEK_FP4}


def deepseek_scaled(src: HFSource, quant: encodings.SourceQuantization | None) -> dict[str, Encoded]:
    """The modules DeepSeek-V4's release stores as `M.weight` (FP8, or FP4 packed in int8) with an
    E8M0 `M.scale`; a `scale` beside any other weight is no encoding's."""
    out = {}
    for name, (f, meta) in src.tensors.items():
        module, _, leaf = name.rpartition(".")
        weight = f"{module}.weight"
        if leaf != "scale" or weight not in src.tensors:
            continue
        encoding = DEEPSEEK_WEIGHTS.get(src.tensors[weight][1].dtype)
        if encoding is None:
            continue
        if quant is None or quant.method != "fp8":
            raise CheckpointError(
                f"{f.path}: {weight!r} is stored {src.tensors[weight][1].dtype} with its scale {name!r}, but "
                "config.json declares no FP8 quantization_config (quant_method fp8), as DeepSeek-V4's release does"
            )
        if meta.dtype not in (torch.float8_e8m0fnu, torch.uint8):
            raise CheckpointError(
                f"{f.path}: {name!r} is {meta.dtype}, not the E8M0 scale (float8_e8m0fnu) of {weight!r}"
            )
        out[module] = Encoded(encoding, FP8_SCHEME, {"weight": weight, "scale": name}, weight)
    return out


def refuse_false_claims(
    src: HFSource, encoded: dict[str, Encoded], quant: encodings.SourceQuantization
) -> dict[str, Encoded]:
    """`encoded`, once config.json's quantization_config is known to be true of the weights: some
    tensor is stored quantized, and no routed expert a compressed-tensors group targets (and no
    ignore entry excepts) is stored plain: converted and exported, the false claim would be passed on."""
    way_out = "remove quantization_config from config.json if the weights are plain, or use the quantized weights"
    if not encoded:
        raise CheckpointError(
            f"{quant.where}: declares {quant.method} quantization, but no tensor of {src.dir} is stored "
            f"quantized; {way_out}"
        )
    if quant.method != encodings.CT:
        return encoded
    groups = quant.groups()
    for name, (f, meta) in src.tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or module in encoded or not ROUTED_EXPERT.match(module) or not meta.dtype.is_floating_point:
            continue
        if any(encodings.matches(module, [i]) for i in quant.ignore):
            continue
        try:
            g = group_of(module, groups, name)
        except CheckpointError:  # no group targets it: plain by the config's own word
            continue
        raise CheckpointError(
            f"{f.path}: {name} is stored plain ({meta.dtype}), but {quant.where} says {module} is "
            f"{groups[g]['format']} ({g}) and no ignore entry excepts it; {way_out}"
        )
    return encoded


def group_of(module: str, groups: dict[str, dict], where: str) -> str:
    """The config group whose scheme a compressed module follows: one that names it (exact or
    `re:`), else one that targets every Linear."""
    named = [
        g
        for g, d in groups.items()
        if any(t != "Linear" and encodings.matches(module, [t]) for t in d.get("targets") or [])
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
