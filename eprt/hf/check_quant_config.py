"""The quantization configs of a ModelOpt-layout export (config.json's quantization_config and
hf_quant_config.json): what vLLM's and SGLang's modelopt loaders read from them, and that the
two agree. eprt.hf.check_export checks the tensors against what these configs say."""

from __future__ import annotations

from eprt.quant.formats import WEIGHT_FORMATS, by_quant_algo
from eprt.quant.formats.kv import KV_CACHE_FORMATS, kv_by_quant_algo
from eprt.storage.hf_files import QUANT_CONFIG

MIXED = "MIXED_PRECISION"  # each module's quant_algo in quantized_layers; an unlisted module is unquantized


ALGOS = tuple(f.quant_algo for f in WEIGHT_FORMATS.values())  # the quant_algos eprt writes


def _bits(algo) -> int | None:
    fmt = by_quant_algo(algo)
    return fmt.num_bits if fmt is not None else None


def _kv_algo_of_scheme(scheme) -> str | None:
    """The kv_cache_quant_algo config.json's kv_cache_scheme stands for (None: no scheme eprt writes)."""
    return next(
        (
            f.quant_algo
            for f in KV_CACHE_FORMATS.values()
            if scheme == f.modelopt_scheme
            or (
                isinstance(scheme, dict)
                and isinstance(f.modelopt_scheme, dict)
                and all(scheme.get(k) == v for k, v in f.modelopt_scheme.items() if k != "dynamic")
            )
        ),
        None,
    )


def check_configs(
    config: dict | None, hf_quant: dict | None, problems: list[str]
) -> tuple[str | None, str | None, list[str]]:
    """(quant_algo, kv_cache_quant_algo, exclude list) after checking both configs agree.

    quant_algo is None when the modules cannot be checked against it.
    """
    qc = None
    if config is not None:
        qc = config.get("quantization_config")
        if qc is None and isinstance(config.get("text_config"), dict):
            qc = config["text_config"].get("quantization_config")
        if not isinstance(qc, dict):
            problems.append("config.json: no quantization_config; engines choose the loader from it")
            qc = None
        elif qc.get("quant_method") != "modelopt":
            problems.append(f"config.json quantization_config.quant_method: {qc.get('quant_method')!r}, not 'modelopt'")
    q = None
    if hf_quant is not None:
        q = hf_quant.get("quantization")
        if not isinstance(q, dict):
            problems.append(f"{QUANT_CONFIG}: no 'quantization' object")
            q = None
    if q is None and qc is None:
        return None, None, []

    algo = (q or qc).get("quant_algo")
    if by_quant_algo(algo) is None and algo != MIXED:
        problems.append(f"quant_algo {algo!r}: this checker covers {', '.join(ALGOS)} and {MIXED} of them")
        algo = None
    kv_algo = q.get("kv_cache_quant_algo") if q is not None else _kv_algo_of_scheme(qc.get("kv_cache_scheme"))
    if kv_algo is not None and kv_by_quant_algo(kv_algo) is None:
        problems.append(
            f"{QUANT_CONFIG} quantization.kv_cache_quant_algo: {kv_algo!r}; eprt exports "
            f"{' or '.join(f.quant_algo for f in KV_CACHE_FORMATS.values())} or null"
        )
    exclude = q.get("exclude_modules", []) if q is not None else qc.get("ignore", [])
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        problems.append(f"{QUANT_CONFIG} quantization.exclude_modules: not a list of names")
        exclude = []

    fmt = by_quant_algo(algo)
    if q is not None and fmt is not None and fmt.group_size is not None:
        for key in ("group_size", "kv_cache_quant_algo", "exclude_modules"):
            if key not in q:
                problems.append(f"{QUANT_CONFIG} quantization.{key}: missing; vLLM requires it for {algo}")
        if "group_size" in q and q["group_size"] != fmt.group_size:
            problems.append(
                f"{QUANT_CONFIG} quantization.group_size: {q['group_size']!r}, {algo} blocks are {fmt.group_size}"
            )
    if algo == MIXED:
        _check_quantized_layers(q, qc, problems)
    if q is None or qc is None:
        return algo, kv_algo, exclude

    if qc.get("quant_algo") != q.get("quant_algo"):
        problems.append(
            f"quant_algo: config.json quantization_config says {qc.get('quant_algo')!r}, "
            f"{QUANT_CONFIG} says {q.get('quant_algo')!r}"
        )
    if algo != MIXED:
        _check_config_groups(qc, algo, q.get("group_size"), problems)
    scheme = qc.get("kv_cache_scheme")
    known_kv = kv_algo if kv_by_quant_algo(kv_algo) is not None else None  # an unknown one is said above
    if known_kv != _kv_algo_of_scheme(scheme) or (kv_algo is None and scheme is not None):
        problems.append(
            f"kv_cache: {QUANT_CONFIG} kv_cache_quant_algo is {kv_algo!r} but config.json "
            f"quantization_config.kv_cache_scheme is {scheme!r}"
        )
    ignore = qc.get("ignore", [])
    if not isinstance(ignore, list) or set(ignore) != set(exclude):
        ignore = set(ignore) if isinstance(ignore, list) else set()
        problems.append(
            f"exclusions: config.json quantization_config.ignore and {QUANT_CONFIG} exclude_modules differ "
            f"(only in ignore: {sorted(ignore - set(exclude))}; "
            f"only in exclude_modules: {sorted(set(exclude) - ignore)})"
        )
    return algo, kv_algo, exclude


def quantized_layers(config: dict | None, hf_quant: dict | None) -> dict[str, str]:
    """A MIXED_PRECISION export's quantized_layers: module -> quant_algo (empty when absent)."""
    q = (hf_quant or {}).get("quantization") if isinstance(hf_quant, dict) else None
    layers = (q or {}).get("quantized_layers")
    if not isinstance(layers, dict):
        layers = ((config or {}).get("quantization_config") or {}).get("quantized_layers")
    if not isinstance(layers, dict):
        return {}
    return {m: c.get("quant_algo") for m, c in layers.items() if isinstance(c, dict)}


def _check_quantized_layers(q: dict | None, qc: dict | None, problems: list[str]) -> None:
    """MIXED_PRECISION: each module's quant_algo (and NVFP4's group_size) in quantized_layers, the
    same in both configs, each config group's bits those of the modules it targets."""
    layers = (q or qc).get("quantized_layers")
    if not isinstance(layers, dict) or not layers:
        problems.append(f"quantized_layers: missing; a {MIXED} export names each quantized module's quant_algo")
        return
    for module, layer in sorted(layers.items()):
        algo = layer.get("quant_algo") if isinstance(layer, dict) else None
        fmt = by_quant_algo(algo)
        if fmt is None:
            problems.append(f"quantized_layers.{module}: quant_algo {algo!r}; eprt exports {' or '.join(ALGOS)}")
        elif fmt.group_size is not None and layer.get("group_size") != fmt.group_size:
            problems.append(
                f"quantized_layers.{module}.group_size: {layer.get('group_size')!r}, {algo} blocks are {fmt.group_size}"
            )
    if q is not None and qc is not None and qc.get("quantized_layers") != q.get("quantized_layers"):
        problems.append(f"quantized_layers: config.json quantization_config and {QUANT_CONFIG} differ")
    groups = (qc or {}).get("config_groups") or {}
    for name, group in sorted(groups.items()):
        bits = {_bits(layers[t].get("quant_algo")) for t in group.get("targets", []) if t in layers}
        declared = (group.get("weights") or {}).get("num_bits")
        if len(bits) > 1 or (bits and declared not in bits):
            problems.append(
                f"config.json quantization_config.config_groups.{name}: num_bits {declared!r} for "
                f"targets quantized with {sorted(bits)} bits"
            )


def _check_config_groups(qc: dict, algo: str | None, group_size, problems: list[str]) -> None:
    if algo is None:
        return
    groups = qc.get("config_groups")
    group = groups.get("group_0") if isinstance(groups, dict) else None
    if not isinstance(group, dict):
        problems.append("config.json quantization_config.config_groups.group_0: missing")
        return
    fmt = by_quant_algo(algo)
    bits = fmt.num_bits
    for part in ("weights", "input_activations") if fmt.modelopt_input_group() is not None else ("weights",):
        spec = group.get(part)
        where = f"config.json quantization_config.config_groups.group_0.{part}"
        if not isinstance(spec, dict):
            problems.append(f"{where}: missing")
            continue
        if spec.get("num_bits") != bits or spec.get("type") != "float":
            problems.append(
                f"{where}: num_bits {spec.get('num_bits')!r} type {spec.get('type')!r}, {algo} is {bits}-bit float"
            )
        if fmt.group_size is not None and spec.get("group_size") != group_size:
            problems.append(f"{where}.group_size: {spec.get('group_size')!r}, {QUANT_CONFIG} says {group_size!r}")
