"""Check a compressed-tensors export (docs/export.md) for what the compressed-tensors loaders
(transformers, vLLM's and SGLang's `compressed-tensors` methods) rely on.

The quantization_config must parse with compressed-tensors' own classes (eprt-check; the export's
own check reads the config it built without the library), be `compressed`, and give each config
group a format eprt writes (a weight format's `ct_format`: `float-quantized` FP8,
`nvfp4-pack-quantized` NVFP4). Each Linear is then matched by the library's rule
(eprt.storage.encodings.matches: `ignore` first, then each group's `targets`: class `Linear`, an
exact name or a `re:` regex) and
must carry exactly its group's tensors with valid scales; an ignored or unmatched Linear keeps a
float `weight` and no scale. Linears the engines fuse must agree on their per-tensor scales in a format that shares
them (NVFP4: one global scale per fused weight), and every routed expert of a layer on its input
scale per projection; a layer of NVFP4 W4A4 routed experts has that input scale on every expert.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from eprt.hf.check_names import SourceNames, attention_modules, check_names
from eprt.quant.formats import WEIGHT_FORMATS, WeightFormat, by_ct_format, by_ct_weight
from eprt.quant.fusion import SAME_INPUT
from eprt.storage.encodings import MIXED_FORMAT, matches

CT_FORMATS = tuple(dict.fromkeys(f.ct_format for f in WEIGHT_FORMATS.values()))
SCALE_LEAVES = {leaf for f in WEIGHT_FORMATS.values() for leaf in list(f.ct_leaves)[1:]}
# every leaf a quantized Linear has in either layout: one of another format's is out of place
QUANTIZED_LEAVES = {leaf for f in WEIGHT_FORMATS.values() for leaf in (*f.ct_leaves, *f.modelopt_leaves)}
PACKED_LEAVES = {f.ct_weight_leaf for f in WEIGHT_FORMATS.values()} - {"weight"}
FLOAT_DTYPES = ("BF16", "F16", "F32")
KV_LEAVES = ("k_scale", "v_scale")
WEIGHT_SHAPE = "weight_shape"  # pack-quantized's [out, in] of the packed weight
ROUTED_EXPERT = re.compile(r"^(?P<moe>.+\.experts)\.\d+\.(?P<kind>gate_proj|up_proj|down_proj|w1|w2|w3)$")
EXPERT_KIND = {
    "gate_proj": "gate_up",
    "up_proj": "gate_up",
    "w1": "gate_up",
    "w3": "gate_up",
    "down_proj": "down",
    "w2": "down",
}


def check_compressed_tensors(
    config: dict, tensors: dict, source: SourceNames | None, problems: list[str], library: bool = True
) -> None:
    """Append one line per violation to `problems`. `tensors`: name -> header (and scale values).
    `library`: parse the quantization_config with compressed-tensors' classes first (a config
    anyone wrote); the export's own check, of the config it built from eprt's table of the
    library's schemes (eprt.hf.compressed_tensors_schemes), leaves the library unimported."""
    groups = _parse_config(config["quantization_config"], problems, library)
    if groups is None or not tensors:
        return
    ignore, by_format = groups
    linears = _linears(tensors)
    formats: dict[str, WeightFormat] = {}
    for module, leaves in sorted(linears.items()):
        fmt = _declared_format(module, ignore, by_format)
        stored = stored_format(module, leaves, tensors, fmt)
        if fmt is None:
            if stored is not None:
                problems.append(
                    f"{module}: quantized ({stored.ct_format}) but the quantization_config "
                    f"{'ignores it' if _ignored(module, ignore) else 'targets it in no group'}; "
                    "the loaders would read it as a float weight"
                )
            else:
                for leaf in sorted(leaves & SCALE_LEAVES):
                    problems.append(f"{module}.{leaf}: unquantized module {module} carries a scale")
            continue
        if stored is not fmt:
            # formats of one compressed-tensors `format` (float-quantized) are told apart by their scales
            said = (
                f"{stored.name}'s tensors"
                if stored and stored.ct_format == fmt.ct_format
                else stored.ct_format
                if stored
                else f"a {_dtype(tensors, module)} weight"
            )
            problems.append(f"{module}: its config group is {fmt.ct_format} ({fmt.name}) but it stores {said}")
            continue
        formats[module] = fmt
        _check_module(module, fmt, tensors, problems)
    _check_shared(formats, tensors, problems)
    _check_w4a4_experts_have_input_scales(linears, formats, tensors, problems)
    kv = _check_kv(config["quantization_config"], ignore, tensors, problems)
    check_names(tensors, {m: tuple(f.ct_leaves) for m, f in formats.items()}, kv, source, problems)


def stored_format(
    module: str, leaves: set[str], tensors: dict, declared: WeightFormat | None = None
) -> WeightFormat | None:
    """The format Linear `module` is stored in, by its leaves (eprt.quant.formats.by_ct_weight), the
    `declared` one of those that store the same where its scales are misshapen."""
    return by_ct_weight(
        leaves, lambda leaf: (tensors[f"{module}.{leaf}"].dtype, tensors[f"{module}.{leaf}"].shape), declared
    )


def _parse_config(qc: dict, problems: list[str], library: bool):
    """(ignore, format -> [targets]) from the quantization_config, or None when it cannot be read.
    With `library`, compressed-tensors' own classes parse it first and what they read is checked:
    the loaders parse it with them, which accept what the JSON spells otherwise (a preset name for
    a group, "INT" for "int", a default left out)."""
    if library:
        qc = _parsed_by_library(qc, problems)
        if qc is None:
            return None
    if qc.get("quantization_status") != "compressed":
        problems.append(
            f"config.json quantization_config.quantization_status: "
            f"{qc.get('quantization_status')!r}; the weights are stored compressed"
        )
    by_format: dict[WeightFormat, list[str]] = defaultdict(list)
    for name, group in qc["config_groups"].items():
        ct_format = group.get("format") or qc.get("format")
        w, a = group.get("weights"), group.get("input_activations")
        fmt = by_ct_format(ct_format, (w or {}).get("strategy"), a is not None, (w or {}).get("group_size"))
        where = f"config.json quantization_config.config_groups.{name}"
        if fmt is None:
            problems.append(f"{where}.format: {ct_format!r}; eprt writes {' or '.join(CT_FORMATS)}")
            continue
        bits = fmt.num_bits
        kind = fmt.ct_weight_type
        if (
            w is None
            or w.get("num_bits") != bits
            or w.get("type") != kind
            or (fmt.group_size is not None and w.get("group_size") != fmt.group_size)
        ):
            size = f" in groups of {fmt.group_size}" if fmt.group_size is not None else ""
            problems.append(f"{where}.weights: not the {bits}-bit {kind} weights{size} of {ct_format} ({fmt.name})")
        want = fmt.modelopt_input_group()
        if want is not None and (a is None or a.get("num_bits") != want["num_bits"] or a.get("type") != want["type"]):
            problems.append(f"{where}.input_activations: not the {want['num_bits']}-bit float inputs of {fmt.name}")
        by_format[fmt] += group["targets"]
    if len(by_format) > 1 and qc.get("format") != MIXED_FORMAT:
        problems.append(
            f"config.json quantization_config.format: {qc.get('format')!r}, its groups use "
            f"{sorted(f.ct_format for f in by_format)}: {MIXED_FORMAT}"
        )
    return list(qc.get("ignore") or []), dict(by_format)


def _parsed_by_library(qc: dict, problems: list[str]) -> dict | None:
    """The quantization_config as compressed-tensors' `QuantizationConfig` reads it (its JSON
    dump), or None, with the problem said, when it cannot."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        problems.append(
            "config.json: a compressed-tensors export; checking it needs the compressed-tensors "
            "library: pip install 'eprt[compressed]'"
        )
        return None
    try:
        return QuantizationConfig.model_validate(qc).model_dump(mode="json")
    except Exception as e:  # pydantic names the field at fault
        problems.append(f"config.json quantization_config: compressed-tensors cannot read it ({e})".splitlines()[0])
        return None


def _linears(tensors: dict) -> dict[str, set[str]]:
    """Every module with a 2-D weight (or packed weight), embeddings aside: module -> its leaves."""
    leaves: dict[str, set[str]] = defaultdict(set)
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        leaves[module].add(leaf)
    return {
        m: ls
        for m, ls in leaves.items()
        if "embed_tokens" not in m
        and (ls & PACKED_LEAVES or ("weight" in ls and len(tensors[f"{m}.weight"].shape) == 2))
    }


def _ignored(module: str, ignore: list[str]) -> bool:
    return matches(module, ignore)


def _declared_format(module: str, ignore: list[str], by_format: dict[WeightFormat, list[str]]) -> WeightFormat | None:
    """The format compressed-tensors applies to Linear `module`: None when ignored or untargeted."""
    if _ignored(module, ignore):
        return None
    return next((fmt for fmt, targets in by_format.items() if matches(module, targets)), None)


def _dtype(tensors: dict, module: str) -> str:
    t = tensors.get(f"{module}.weight")
    return t.dtype if t is not None else "missing"


def _check_module(module: str, fmt: WeightFormat, tensors: dict, problems: list[str]) -> None:
    for leaf, dtype in fmt.ct_leaves.items():
        t = tensors.get(f"{module}.{leaf}")
        if t is None:
            problems.append(f"{module}.{leaf}: missing ({fmt.ct_format} module {module})")
        elif t.dtype != dtype:
            problems.append(f"{module}.{leaf}: {t.dtype}, {fmt.ct_format} stores {dtype}")
    for leaf in filter(None, fmt.ct_per_tensor_scales):
        t = tensors.get(f"{module}.{leaf}")
        if t is None or t.dtype != "F32":
            continue
        if t.shape != (1,):
            problems.append(f"{module}.{leaf}: shape {list(t.shape)}, a per-tensor scale is [1]")
        elif not (math.isfinite(t.value) and t.value > 0):
            problems.append(f"{module}.{leaf}: {t.value}, a scale must be finite and positive")
    if fmt.block_scale_leaf:
        packed, grid = tensors.get(f"{module}.{fmt.ct_weight_leaf}"), tensors.get(f"{module}.{fmt.block_scale_leaf}")
        if packed is not None and grid is not None and grid.dtype == fmt.ct_leaves[fmt.block_scale_leaf]:
            in_dim = fmt.in_dim_of_stored(packed.shape[1]) if len(packed.shape) == 2 else 0
            want = (
                fmt.compressed_tensors_tensors(packed.shape[0], in_dim)[fmt.block_scale_leaf][1]
                if len(packed.shape) == 2
                else ()
            )
            if len(packed.shape) != 2 or fmt.unfit_input_dim(in_dim) or grid.shape != want:
                problems.append(
                    f"{module}.{fmt.block_scale_leaf}: {list(grid.shape)}, expected {list(want)} block "
                    f"scales for {fmt.ct_weight_leaf} {list(packed.shape)}"
                )
            elif grid.bad_block_scales:
                problems.append(
                    f"{module}.{fmt.block_scale_leaf}: {grid.bad_block_scales} block scale(s) zero, negative or NaN"
                )
    _check_weight_shape(module, fmt, tensors, problems)
    extra = {n.rpartition(".")[2] for n in tensors if n.rpartition(".")[0] == module} - set(fmt.ct_leaves) - {"bias"}
    for leaf in sorted(extra & QUANTIZED_LEAVES):
        problems.append(f"{module}.{leaf}: not part of a {fmt.ct_format} module")


def _check_weight_shape(module: str, fmt: WeightFormat, tensors: dict, problems: list[str]) -> None:
    """A pack-quantized Linear's weight_shape: the [out, in] its packed weight holds, which the
    library unpacks to (a wrong one cuts or pads every row)."""
    packed, shape = tensors.get(f"{module}.{fmt.ct_weight_leaf}"), tensors.get(f"{module}.{WEIGHT_SHAPE}")
    if WEIGHT_SHAPE not in fmt.ct_leaves or packed is None or shape is None or len(packed.shape) != 2:
        return
    want = [packed.shape[0], fmt.in_dim_of_stored(packed.shape[1])]
    if shape.ints is None or list(shape.ints) != want:
        got = list(shape.ints) if shape.ints is not None else f"{shape.dtype} {list(shape.shape)}"
        problems.append(
            f"{module}.{WEIGHT_SHAPE}: {got}, its {fmt.ct_weight_leaf} {list(packed.shape)} holds a weight {want}"
        )


def _value(tensors: dict, name: str):
    t = tensors.get(name)
    return None if t is None else t.value


def _check_shared(formats: dict[str, WeightFormat], tensors: dict, problems: list[str]) -> None:
    """Fused siblings agree on the per-tensor scales the engine keeps one of (in a format that
    shares them); routed experts of a layer on their input scale per projection (every format)."""
    for module in sorted(m for m, f in formats.items() if f.shares_fused_scales):
        fmt = formats[module]
        parent, _, leaf = module.rpartition(".")
        group = next((g for g in SAME_INPUT if leaf in g), ())
        first = next((f"{parent}.{x}" for x in group if formats.get(f"{parent}.{x}") is fmt), module)
        for scale in filter(None, fmt.ct_per_tensor_scales):
            a, b = _value(tensors, f"{first}.{scale}"), _value(tensors, f"{module}.{scale}")
            if a is not None and b is not None and a != b:
                problems.append(
                    f"{module}.{scale}: {b} differs from {first}.{scale} {a}; "
                    f"{'/'.join(group)} are loaded fused with one {scale}"
                )
    layer_inputs: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for module, fmt in formats.items():
        m = ROUTED_EXPERT.match(module)
        scale = fmt.ct_input_scale_leaf
        value = _value(tensors, f"{module}.{scale}") if scale else None
        if m and value is not None:
            layer_inputs[m["moe"], EXPERT_KIND[m["kind"]]][f"{module}.{scale}"] = value
    for (moe, kind), values in sorted(layer_inputs.items()):
        common = max(set(values.values()), key=list(values.values()).count)
        for name, value in sorted(values.items()):
            if value != common:
                problems.append(
                    f"{name}: {value}, other {kind} experts of {moe} have {common}; "
                    "the fused MoE loads one input scale per projection"
                )


def _check_w4a4_experts_have_input_scales(
    linears: dict[str, set[str]], formats: dict[str, WeightFormat], tensors: dict, problems: list[str]
) -> None:
    """A layer whose routed experts are NVFP4 W4A4 has an input scale on every expert projection:
    the engines load the layer's experts as one fused NVFP4 MoE, whatever the config says of one of
    them (ignored, or in a weight-only group), and vLLM reads an input scale the export lacks as 0,
    then divides by it (an inf global scale, NaN for every token routed there)."""
    by_layer: dict[str, list[str]] = defaultdict(list)
    for module in linears:
        if m := ROUTED_EXPERT.match(module):
            by_layer[m["moe"]].append(module)
    for moe, modules in sorted(by_layer.items()):
        w4a4 = [m for m in modules if formats.get(m) is not None and formats[m].quant_algo == "NVFP4"]
        leaf = formats[w4a4[0]].ct_input_scale_leaf if w4a4 else None
        # a W4A4 module without its scale is named by its own check; these are the others
        lacking = sorted(m for m in modules if m not in w4a4 and f"{m}.{leaf}" not in tensors)
        if w4a4 and lacking:
            problems.append(
                f"{moe}: NVFP4 W4A4 routed experts, but {len(lacking)} expert projection(s) have no {leaf} "
                f"({', '.join(lacking[:3])}{', ...' if len(lacking) > 3 else ''}); the engines load the layer's "
                f"experts as one fused NVFP4 MoE and vLLM reads a missing {leaf} as 0, an inf global scale: "
                "quantize every expert of the layer in the same W4A4 format"
            )


def _check_kv(qc: dict, ignore: list[str], tensors: dict, problems: list[str]) -> tuple[str, ...]:
    """The KV-cache scales: on every attention (`...self_attn.k_scale`, F32 [1]) exactly when the
    config declares a kv_cache_scheme, but an ignored one (a layer carried through unmodeled,
    DeepSeek-V3's MTP layer). Returns the KV leaves the export may hold."""
    declared = qc.get("kv_cache_scheme") is not None
    attentions = attention_modules(tensors)
    for name in sorted(tensors):
        module, _, leaf = name.rpartition(".")
        if leaf in KV_LEAVES and not declared:
            problems.append(f"{name}: KV-cache scale in an export without kv_cache_scheme")
    if not declared:
        return ()
    for attn in sorted(attentions):
        if f"{attn}.A_log" in tensors or _ignored(attn, ignore):  # KDA keeps a recurrent state, not a KV cache
            continue
        for leaf in KV_LEAVES:
            t = tensors.get(f"{attn}.{leaf}")
            if t is None:
                problems.append(f"{attn}.{leaf}: missing; the quantization_config declares a kv_cache_scheme")
            elif t.dtype != "F32" or t.shape != (1,) or not (math.isfinite(t.value) and t.value > 0):
                problems.append(f"{attn}.{leaf}: {t.dtype} {list(t.shape)} {t.value}, expected a positive F32 [1]")
    return KV_LEAVES
