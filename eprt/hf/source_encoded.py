"""Which weights of a Hugging Face source are stored encoded, and how: each registered source
encoding (eprt.storage.source_decoders; eprt's own, block and per-tensor FP8, DeepSeek-V4's FP8 and
FP4, GPT-OSS's MXFP4 and compressed-tensors' formats, are entries too) finds its weights by the
tensors' names and dtypes, and the source's quantization_config must be true of them. Convert and
the model-free export plan from what this finds."""

from __future__ import annotations

from dataclasses import dataclass

from eprt.errors import CheckpointError
from eprt.hf.check_modelopt import ROUTED_EXPERT
from eprt.hf.source import HFSource
from eprt.storage import encodings, source_decoders
from eprt.storage.source_finders import group_of


@dataclass(frozen=True)
class Encoded:
    """The source tensors of one encoded weight."""

    encoding: str
    scheme: str  # the quantization_config group (compressed-tensors), else its quant_method (fp8, mxfp4, ...)
    components: dict[str, str]  # local name (weight_packed, ...) -> Hugging Face name
    weight: str  # the Hugging Face name of the weight they decode to (`M.weight`, or a fused `P`)


def source_module(hf_weight: str) -> str | None:
    """The module a source weight belongs to (its name without `.weight`); None for any other tensor."""
    return hf_weight[: -len(".weight")] if hf_weight.endswith(".weight") else None


def encoded_modules(src: HFSource, quant: encodings.SourceQuantization | None) -> dict[str, Encoded]:
    """Every module whose weight the source stores encoded, by module name (a fused parameter's by
    its own); refuses encoded tensors that its quantization_config does not account for."""
    infos = {n: info for n, (_, info) in src.tensors.items()}
    files = {n: f.path for n, (f, _) in src.tensors.items()}
    out = {
        source_module(weight) or weight: Encoded(encoding, scheme, parts, weight)
        for weight, (encoding, scheme, parts) in source_decoders.find_encoded(infos, quant, src.dir, files).items()
    }
    return out if quant is None else refuse_false_claims(src, out, quant)


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
