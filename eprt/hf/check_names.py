"""The name check of a quantized export: every tensor is one an engine loads.

An export holds the source's tensors, with each quantized Linear's `weight` replaced by its
format's companions (`WeightFormat.modelopt_leaves`: `weight`, `weight_scale`, [`weight_scale_2`],
`input_scale`), plus the KV-cache scales of an attention under a quantized KV cache, and nothing else:
vLLM refuses a checkpoint holding a tensor its model has no parameter for.

The source's names come from the source directory when one is given (then the export must hold
exactly the predicted set), else from the family layout of the export's own config.json (names
outside it are refused, missing ones are not looked for). A config eprt cannot read leaves only
the rule that holds for every model: no `*amax` tensor and no integer tensor other than an
NVFP4 weight or a quantized weight's companions.
"""

from __future__ import annotations

import re

from eprt.errors import EprtError
from eprt.families import load_hf_config, parse_hf_config, read_hf_config, reader_for
from eprt.hf.check_unmodeled import split_stacks
from eprt.hf.source import HFSource
from eprt.layout import Layout
from eprt.storage.hf_files import CONFIG

KV_COMPANIONS = ("k_proj.k_scale", "v_proj.v_scale")  # under an attention module (compressed-tensors: k_scale, v_scale)
# A source Linear stored encoded (compressed-tensors, block or per-tensor FP8, DeepSeek-V4's FP8 and FP4
# with their E8M0 `scale`) is exported decoded, as `weight`.
ENCODED_MARKERS = ("weight_packed", "weight_scale_inv", "scale")
ENCODED_PARTS = (
    "weight_packed",
    "weight_scale",
    "weight_scale_inv",
    "weight_shape",
    "weight_zero_point",
    "weight_global_scale",
    "activation_scale",  # per-tensor FP8 with static activations
    "scale",  # DeepSeek-V4's
)
# Fused experts stored in per-tensor FP8 (a parameter P, not a module's weight): P's parts beside it.
FUSED_ENCODED_PARTS = ("_scale_inv", "_activation_scale")
# Fused experts stored in OpenAI's MXFP4 (GPT-OSS: eprt.storage.mxfp4_blocks): P's parts, without P.
MXFP4_PARTS = ("_blocks", "_scales")
INTEGER_DTYPES = ("I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL")
# A multi-token-prediction layer's Linears the engines build without quantization, whatever the
# config says: vLLM and SGLang make eh_proj a plain torch Linear and shared_head.head an lm head.
MTP_UNQUANTIZED = re.compile(r".*\.layers\.\d+\.(eh_proj|shared_head\.head)")


class SourceNames:
    """The source tensors an export may carry: exact names, plus regexes for tensors carried through."""

    def __init__(
        self,
        names: set[str],
        passthrough: tuple[str, ...] = (),
        exact: bool = False,
        unquantized: tuple[str, ...] = (),
        split: dict[str, frozenset[str]] | None = None,
    ):
        self.names = names
        self.passthrough = passthrough
        self.exact = exact  # the whole source is known: a missing tensor is a fault too
        # a model eprt does not model: each stack of experts -> its experts' tensors, which the
        # export holds in its place where it quantizes them (both are in `names`)
        self.split = split or {}
        self.stack_of = {n: stack for stack, names_ in self.split.items() for n in names_}
        # regexes over the modules the engines build unquantized in the source's family (Family.unquantized)
        self.unquantized = unquantized

    def built_unquantized(self, module: str) -> bool:
        return any(re.fullmatch(p, module) for p in self.unquantized)

    def __contains__(self, name: str) -> bool:
        return name in self.names or any(re.fullmatch(p, name) for p in self.passthrough)

    def held_otherwise(self, name: str, held) -> bool:
        """Whether source tensor `name` is in the export in its other form: a stack expert by expert,
        or an expert's tensor inside its stack carried whole (`held`: whether a name is in the export)."""
        if name in self.split:
            return all(held(n) for n in self.split[name])
        return name in self.stack_of and held(self.stack_of[name])


def decoded_names(names) -> set[str]:
    """Source names with each encoded weight's stored parts (`M.weight_packed`, ..., a fused `P_blocks`
    and `P_scales`) as the one weight (`M.weight`, `P`)."""
    names = set(names)
    encoded = {n.rsplit(".", 1)[0] for n in names if n.rsplit(".", 1)[-1] in ENCODED_MARKERS}
    out = set()
    for n in names:
        module, _, leaf = n.rpartition(".")
        fused = next((n[: -len(p)] for p in FUSED_ENCODED_PARTS if n.endswith(p) and n[: -len(p)] in names), None)
        mxfp4 = next((n[: -len(p)] for p in MXFP4_PARTS if n.endswith(p) and mxfp4_parts(n[: -len(p)]) <= names), None)
        out.add(f"{module}.weight" if module in encoded and leaf in ENCODED_PARTS else fused or mxfp4 or n)
    return out


def mxfp4_parts(weight: str) -> set[str]:
    return {weight + p for p in MXFP4_PARTS}


def source_names_from_dir(source_dir: str) -> SourceNames:
    src = HFSource(source_dir)
    try:
        layout = family_layout(source_dir)
        names = per_expert_names(decoded_names(src.tensors), layout)
        if layout is not None:
            return SourceNames(names, exact=True, unquantized=layout.unquantized)
        shapes = {n: tuple(info.shape) for n, (_, info) in src.tensors.items()}
        split = {n: frozenset(e) for n, e in split_stacks(shapes, read_hf_config(source_dir)).items()}
        return SourceNames(names.union(*split.values()), exact=True, split=split)
    finally:
        src.close()


def family_layout(source_dir: str) -> Layout | None:
    """The layout of the family of `source_dir`'s config.json, or None where eprt does not read it."""
    try:
        _, cfg = load_hf_config(source_dir)
        return reader_for(cfg.model_type, source_dir).layout(cfg)
    except EprtError:
        return None


def per_expert_names(names: set[str], layout: Layout | None) -> set[str]:
    """Source names with routed experts held fused (eprt.layout.TensorSpec.fused) as the per-expert
    names the quantized export writes them under: engines load a quantized expert per expert."""
    for spec in layout.specs if layout is not None else ():
        if spec.fused in names:
            names = (names - {spec.fused}) | set(spec.sources)
    return names


def source_names_from_config(config: dict | None) -> SourceNames | None:
    """The names eprt's family layout predicts from `config`; None when eprt cannot read it."""
    try:
        cfg = parse_hf_config(config or {})
        layout = reader_for(cfg.model_type, CONFIG).layout(cfg)
    except (EprtError, KeyError, TypeError, ValueError):
        return None
    # the MTP layers eprt models are known name by name (their fused-experts form too, as a source
    # may hold it): their passthrough patterns would admit anything under their prefix
    mtp = {s for spec in layout.mtp for s in (*spec.sources, *([spec.fused] if spec.fused else []))}
    passthrough = tuple(p for p in layout.passthrough if not any(re.fullmatch(p, n) for n in mtp))
    # a tensor spelled two ways (eprt.layout.TensorSpec.alias) may be under either name
    aliases = {spec.alias for spec in layout.specs if spec.alias}
    return SourceNames(
        {s for spec in layout.specs for s in spec.sources} | aliases | mtp, passthrough, unquantized=layout.unquantized
    )


def check_names(
    tensors: dict,
    companions: dict[str, tuple[str, ...]],
    kv_companions: tuple[str, ...],
    source: SourceNames | None,
    problems: list[str],
) -> None:
    """Refuse every tensor no engine loads; with an exact source, every tensor missing too.

    `tensors`: name -> object with `.dtype` (safetensors spelling); `companions`: each module
    whose weight is quantized -> the leaves its format writes in place of `weight`;
    `kv_companions`: the KV-cache scales under each attention module (none without an FP8 KV cache)."""
    quantized = set(companions)
    allowed_kv = {f"{attn}.{suffix}" for attn in _attentions(tensors, source) for suffix in kv_companions}
    for name in sorted(tensors):
        module, _, leaf = name.rpartition(".")
        if module in quantized and leaf in companions[module]:
            if leaf == "weight" and (m := MTP_UNQUANTIZED.fullmatch(module)):
                problems.append(
                    f"{name}: quantized, but vLLM and SGLang build a multi-token-prediction layer's "
                    f"{m.group(1)} unquantized and cannot load it; keep it in the source dtype"
                )
            if leaf == "weight" and source is not None and source.built_unquantized(module):
                problems.append(
                    f"{name}: quantized, but the engines build {module} unquantized in this family (a router, "
                    "an embedding, a projection they load without a quantization config); keep it in the source dtype"
                )
            if source is not None and f"{module}.weight" not in source:
                problems.append(f"{name}: quantized module {module} is not in the source; no engine has it")
            continue
        if name in allowed_kv:
            continue
        if source is not None:
            if name not in source:
                problems.append(
                    f"{name}: not a source tensor nor a companion of a quantized module; "
                    "no engine loads it (vLLM refuses the checkpoint)"
                )
        elif leaf.endswith("amax") or tensors[name].dtype in INTEGER_DTYPES:
            problems.append(
                f"{name}: {tensors[name].dtype} calibration state, not a tensor any engine loads; "
                "vLLM refuses the checkpoint"
            )
    if source is not None and source.exact:

        def held(name: str) -> bool:
            module, _, leaf = name.rpartition(".")
            return name in tensors or (leaf == "weight" and module in quantized)

        for name in sorted(source.names):
            if not held(name) and not source.held_otherwise(name, held):
                problems.append(f"{name}: a source tensor missing from the export")


def _attentions(tensors: dict, source: SourceNames | None) -> set[str]:
    """Attention modules of the source, or of the export when the source is unknown."""
    return attention_modules(source.names if source is not None else tensors)


def attention_modules(names) -> set[str]:
    """The attention modules among tensor `names`: every `...self_attn`, and a module of another name
    that holds both a k_proj and a v_proj (Nemotron-H's `mixer`, the one mixer of an attention layer)."""
    found = {m.group(1) for n in names if (m := re.match(r"(.*\.self_attn)\.", n))}
    projections: dict[str, set[str]] = {}
    for n in names:
        if m := re.match(r"(.*)\.([kv]_proj)\.", n):
            projections.setdefault(m.group(1), set()).add(m.group(2))
    return found | {module for module, held in projections.items() if len(held) == 2}
