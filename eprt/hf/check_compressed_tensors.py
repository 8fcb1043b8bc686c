"""Check a compressed-tensors export (docs/export.md) for what the compressed-tensors loaders
(transformers, vLLM's and SGLang's `compressed-tensors` methods) rely on.

The quantization_config must parse with compressed-tensors' own classes, be `compressed`, and
give each config group a format eprt writes (`float-quantized` FP8, `nvfp4-pack-quantized`
NVFP4). Each Linear is then matched as the library matches it (`ignore` first, then each
group's `targets`: class `Linear`, an exact name or a `re:` regex) and must carry exactly its
group's tensors with valid scales; an ignored or unmatched Linear keeps a float `weight` and no
scale. Linears the engines fuse must agree on their per-tensor scales under NVFP4 (one global
scale per fused weight), and every routed expert of a layer on its input scale per projection.
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

from eprt.hf.check_names import SourceNames, check_names
from eprt.quant.nvfp4 import BLOCK_SIZE as NVFP4_GROUP

# compressed-tensors format -> (the tensors of a quantized Linear: leaf -> dtype)
LAYOUT = {
    "float-quantized": {"weight": "F8_E4M3", "weight_scale": "F32", "input_scale": "F32"},
    "nvfp4-pack-quantized": {"weight_packed": "U8", "weight_scale": "F8_E4M3", "weight_global_scale": "F32",
                             "input_global_scale": "F32"},
}
PER_TENSOR = {"float-quantized": ("weight_scale", "input_scale"),
              "nvfp4-pack-quantized": ("weight_global_scale", "input_global_scale")}
SCALE_LEAVES = {leaf for layout in LAYOUT.values() for leaf in layout if leaf not in ("weight", "weight_packed")}
FLOAT_DTYPES = ("BF16", "F16", "F32")
KV_LEAVES = ("k_scale", "v_scale")
# Linears that read one input and that the engines load as one fused weight; gate/up of an expert too.
SAME_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa"),
              ("w1", "w3"))
ROUTED_EXPERT = re.compile(r"^(?P<moe>.+\.experts)\.\d+\.(?P<kind>gate_proj|up_proj|down_proj|w1|w2|w3)$")
EXPERT_KIND = {"gate_proj": "gate_up", "up_proj": "gate_up", "w1": "gate_up", "w3": "gate_up",
               "down_proj": "down", "w2": "down"}


def check_compressed_tensors(config: dict, tensors: dict, source: SourceNames | None, problems: list[str]) -> None:
    """Append one line per violation to `problems`. `tensors`: name -> header (and scale values)."""
    groups = _parse_config(config["quantization_config"], problems)
    if groups is None or not tensors:
        return
    ignore, by_format = groups
    linears = _linears(tensors)
    companions = {}
    for module, leaves in sorted(linears.items()):
        fmt = _declared_format(module, ignore, by_format)
        stored = "nvfp4-pack-quantized" if "weight_packed" in leaves else (
            "float-quantized" if tensors.get(f"{module}.weight") and tensors[f"{module}.weight"].dtype == "F8_E4M3"
            else None)
        if fmt is None:
            if stored is not None:
                problems.append(f"{module}: quantized ({stored}) but the quantization_config "
                                f"{'ignores it' if _ignored(module, ignore) else 'targets it in no group'}; "
                                "the loaders would read it as a float weight")
            else:
                for leaf in sorted(leaves & SCALE_LEAVES):
                    problems.append(f"{module}.{leaf}: unquantized module {module} carries a scale")
            continue
        if stored != fmt:
            problems.append(f"{module}: its config group is {fmt} but it stores "
                            f"{stored or 'a ' + _dtype(tensors, module) + ' weight'}")
            continue
        companions[module] = tuple(LAYOUT[fmt])
        _check_module(module, fmt, tensors, problems)
    _check_shared(companions, tensors, problems)
    kv = _check_kv(config["quantization_config"], ignore, tensors, problems)
    check_names(tensors, companions, kv, source, problems)


def _parse_config(qc: dict, problems: list[str]):
    """(ignore, format -> [targets]) from the quantization_config, or None when it cannot be read."""
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        problems.append("config.json: a compressed-tensors export; checking it needs the compressed-tensors "
                        "library: pip install 'eprt[compressed]'")
        return None
    try:
        parsed = QuantizationConfig.model_validate(qc)
    except Exception as e:  # pydantic names the field at fault
        problems.append(f"config.json quantization_config: compressed-tensors cannot read it ({e})".splitlines()[0])
        return None
    if str(getattr(parsed.quantization_status, "value", parsed.quantization_status)) != "compressed":
        problems.append(f"config.json quantization_config.quantization_status: "
                        f"{qc.get('quantization_status')!r}; the weights are stored compressed")
    by_format: dict[str, list[str]] = defaultdict(list)
    for name, group in parsed.config_groups.items():
        fmt = group.format or parsed.format
        where = f"config.json quantization_config.config_groups.{name}"
        if fmt not in LAYOUT:
            problems.append(f"{where}.format: {fmt!r}; eprt writes {' or '.join(LAYOUT)}")
            continue
        bits = 8 if fmt == "float-quantized" else 4
        w = group.weights
        if w is None or w.num_bits != bits or w.type != "float" or (bits == 4 and w.group_size != NVFP4_GROUP):
            problems.append(f"{where}.weights: not the {bits}-bit float weights of {fmt}")
        a = group.input_activations
        if a is None or a.num_bits != bits or a.type != "float":
            problems.append(f"{where}.input_activations: not the {bits}-bit float inputs of {fmt}")
        by_format[fmt] += group.targets
    if len(by_format) > 1 and parsed.format != "mixed-precision":
        problems.append(f"config.json quantization_config.format: {parsed.format!r}, its groups use "
                        f"{sorted(by_format)}: mixed-precision")
    return list(parsed.ignore or []), dict(by_format)


def _linears(tensors: dict) -> dict[str, set[str]]:
    """Every module with a 2-D weight (or packed weight), embeddings aside: module -> its leaves."""
    leaves: dict[str, set[str]] = defaultdict(set)
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        leaves[module].add(leaf)
    return {m: ls for m, ls in leaves.items() if "embed_tokens" not in m and (
        "weight_packed" in ls or ("weight" in ls and len(tensors[f"{m}.weight"].shape) == 2))}


def _ignored(module: str, ignore: list[str]) -> bool:
    from compressed_tensors.utils.match import match_name

    return any(match_name(module, entry) for entry in ignore)


def _declared_format(module: str, ignore: list[str], by_format: dict[str, list[str]]) -> str | None:
    """The format compressed-tensors applies to Linear `module`: None when ignored or untargeted."""
    from compressed_tensors.utils.match import match_name

    if _ignored(module, ignore):
        return None
    for fmt, targets in by_format.items():
        if any(t == "Linear" or match_name(module, t) for t in targets):
            return fmt
    return None


def _dtype(tensors: dict, module: str) -> str:
    t = tensors.get(f"{module}.weight")
    return t.dtype if t is not None else "missing"


def _check_module(module: str, fmt: str, tensors: dict, problems: list[str]) -> None:
    for leaf, dtype in LAYOUT[fmt].items():
        t = tensors.get(f"{module}.{leaf}")
        if t is None:
            problems.append(f"{module}.{leaf}: missing ({fmt} module {module})")
        elif t.dtype != dtype:
            problems.append(f"{module}.{leaf}: {t.dtype}, {fmt} stores {dtype}")
    for leaf in PER_TENSOR[fmt]:
        t = tensors.get(f"{module}.{leaf}")
        if t is None or t.dtype != "F32":
            continue
        if t.shape != (1,):
            problems.append(f"{module}.{leaf}: shape {list(t.shape)}, a per-tensor scale is [1]")
        elif not (math.isfinite(t.value) and t.value > 0):
            problems.append(f"{module}.{leaf}: {t.value}, a scale must be finite and positive")
    if fmt == "nvfp4-pack-quantized":
        packed, grid = tensors.get(f"{module}.weight_packed"), tensors.get(f"{module}.weight_scale")
        if packed is not None and grid is not None and grid.dtype == "F8_E4M3":
            want = (packed.shape[0], packed.shape[1] * 2 // NVFP4_GROUP)
            if len(packed.shape) != 2 or (packed.shape[1] * 2) % NVFP4_GROUP or grid.shape != want:
                problems.append(f"{module}.weight_scale: {list(grid.shape)}, expected {list(want)} block scales "
                                f"for weight_packed {list(packed.shape)}")
            elif grid.bad_block_scales:
                problems.append(f"{module}.weight_scale: {grid.bad_block_scales} block scale(s) zero, negative or NaN")
    extra = {n.rpartition(".")[2] for n in tensors if n.rpartition(".")[0] == module} - set(LAYOUT[fmt]) - {"bias"}
    for leaf in sorted(extra & (SCALE_LEAVES | {"weight", "weight_packed", "weight_scale_2"})):
        problems.append(f"{module}.{leaf}: not part of a {fmt} module")


def _value(tensors: dict, name: str):
    t = tensors.get(name)
    return None if t is None else t.value


def _check_shared(companions: dict[str, tuple[str, ...]], tensors: dict, problems: list[str]) -> None:
    """Fused siblings agree on the per-tensor scales the engine keeps one of (NVFP4); routed experts
    of a layer on their input scale per projection (both formats)."""
    nvfp4 = {m for m, leaves in companions.items() if "weight_packed" in leaves}
    for module in sorted(nvfp4):
        parent, _, leaf = module.rpartition(".")
        group = next((g for g in SAME_INPUT if leaf in g), ())
        first = next((f"{parent}.{x}" for x in group if f"{parent}.{x}" in nvfp4), module)
        for scale in PER_TENSOR["nvfp4-pack-quantized"]:
            a, b = _value(tensors, f"{first}.{scale}"), _value(tensors, f"{module}.{scale}")
            if a is not None and b is not None and a != b:
                problems.append(f"{module}.{scale}: {b} differs from {first}.{scale} {a}; "
                                f"{'/'.join(group)} are loaded fused with one {scale}")
    layer_inputs: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for module, leaves in companions.items():
        m = ROUTED_EXPERT.match(module)
        scale = "input_global_scale" if "weight_packed" in leaves else "input_scale"
        value = _value(tensors, f"{module}.{scale}")
        if m and value is not None:
            layer_inputs[m["moe"], EXPERT_KIND[m["kind"]]][f"{module}.{scale}"] = value
    for (moe, kind), values in sorted(layer_inputs.items()):
        common = max(set(values.values()), key=list(values.values()).count)
        for name, value in sorted(values.items()):
            if value != common:
                problems.append(f"{name}: {value}, other {kind} experts of {moe} have {common}; "
                                "the fused MoE loads one input scale per projection")


def _check_kv(qc: dict, ignore: list[str], tensors: dict, problems: list[str]) -> tuple[str, ...]:
    """The KV-cache scales: on every attention (`...self_attn.k_scale`, F32 [1]) exactly when the
    config declares a kv_cache_scheme, but an ignored one (a layer carried through unmodeled,
    DeepSeek-V3's MTP layer). Returns the KV leaves the export may hold."""
    declared = qc.get("kv_cache_scheme") is not None
    attentions = {m.group(1) for n in tensors if (m := re.match(r"(.*\.self_attn)\.", n))}
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
