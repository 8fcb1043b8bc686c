"""Check a quantized Hugging Face export (docs/export.md) for what vLLM's and SGLang's modelopt
loaders rely on (a compressed-tensors export: eprt.hf.check_compressed_tensors; GPT-OSS's release
layout, quant_method mxfp4: eprt.hf.check_mxfp4_blocks).

`check_export(out_dir)` returns one line per violation, each naming the tensor, module or config
key at fault; an empty list means the export passed. Only headers and scale tensors are read,
never the quantized weights. What the checker passes, an engine loads, so beside the layout's own
rules: every file it reads lies inside the export (eprt.storage.paths), every tensor has the shape
config.json gives it (eprt.hf.check_shapes), and every scale survives the engines' fp32
arithmetic (eprt.hf.check_scale_range), in both layouts. The files are read by eprt.hf.check_files,
a ModelOpt export's Linears checked by eprt.hf.check_modelopt and its KV-cache scales by
eprt.hf.check_kv; what a format stores, each format says (eprt.quant.formats).

Exclusion matching follows the engines. vLLM skips a module when an exclude entry equals its name,
is a substring of it, or matches it as an fnmatch pattern (after splitting a pattern `X*` into `X`
and `X.*`); it asks for fused names (`qkv_proj`, `gate_up_proj`, `fused_qkv_a_proj`, and the
routed experts of a layer as one `...experts` module), not for the checkpoint's own. SGLang
matches exact names and `*` patterns. So an unquantized Linear must be listed by exact name or a
pattern (narrow reading) and its fused name must be skipped too, while a quantized module must
not be matched by any engine's reading (broad reading, substrings included: eprt.hf.check_exclusions).
"""

from __future__ import annotations

import math
from pathlib import Path

from eprt.errors import EprtError
from eprt.families import read_hf_config
from eprt.hf.check_compressed_tensors import check_compressed_tensors, stored_format
from eprt.hf.check_files import StoredTensor, read_json, read_tensors
from eprt.hf.check_kv import KV_SCALES, check_kv_scales
from eprt.hf.check_modelopt import ModelOptModules
from eprt.hf.check_mxfp4_blocks import check_mxfp4_blocks, is_mxfp4_blocks
from eprt.hf.check_names import KV_COMPANIONS, check_names, source_names_from_config, source_names_from_dir
from eprt.hf.check_quant_config import MIXED, check_configs, quantized_layers
from eprt.hf.check_scale_range import Scale, check_kv, check_linear
from eprt.hf.check_shapes import check_shapes, source_specs
from eprt.hf.check_unmodeled import source_shape_specs
from eprt.quant.formats import WeightFormat
from eprt.quant.formats.kv import KvCacheFormat, kv_by_ct_scheme
from eprt.storage.encodings import without_quantization
from eprt.storage.hf_files import CONFIG, QUALITY, QUANT_CONFIG


def check_export(out_dir, source_dir=None, library: bool = True) -> list[str]:
    """Violations of the ModelOpt layout in the export at `out_dir`; empty when it passes.
    `library`: parse a compressed-tensors config with the library's classes (check_compressed_tensors).

    Every tensor must be one an engine loads (`eprt.hf.check_names`); with `source_dir` (the
    Hugging Face checkpoint the export was made from) the export's name set must be exactly the
    source's, each quantized Linear's weight replaced by its companions."""
    out = Path(out_dir)
    if not out.is_dir():
        return [f"{out}: not a directory"]
    problems: list[str] = []
    config = read_json(out / CONFIG, problems)
    if (out / QUALITY).exists():  # the PTQ quality report: engines ignore it, but it must be what it says
        read_json(out / QUALITY, problems)
    if is_mxfp4_blocks(config):
        tensors = read_tensors(out, problems)
        if tensors:
            check_mxfp4_blocks(config, tensors, source_dir, problems)
        return problems
    if is_compressed_tensors(config):
        tensors = read_tensors(out, problems)
        check_compressed_tensors(config, tensors, _source_names(config, source_dir, problems), problems, library)
        formats = ct_formats(tensors)
        _check_ct_scale_range(
            tensors, formats, kv_by_ct_scheme(config["quantization_config"].get("kv_cache_scheme")), problems
        )
        _check_shapes(
            config, source_dir, tensors, {m: f.compressed_tensors_tensors for m, f in formats.items()}, problems
        )
        return problems
    hf_quant = read_json(out / QUANT_CONFIG, problems)
    algo, kv_algo, exclude = check_configs(config, hf_quant, problems)
    tensors = read_tensors(out, problems)
    if algo is not None and tensors:
        modules = ModelOptModules(
            tensors, algo, exclude, problems, quantized_layers(config, hf_quant) if algo == MIXED else None
        )
        modules.check()
        check_kv_scales(tensors, kv_algo, modules.entries, problems)
        source = _source_names(config, source_dir, problems)
        check_names(
            tensors,
            {m: f.modelopt_leaves for m, f in modules.format_of.items()},
            KV_COMPANIONS if kv_algo else (),
            source,
            problems,
        )
        _check_shapes(
            config, source_dir, tensors, {m: f.modelopt_tensors for m, f in modules.format_of.items()}, problems
        )
    return problems


def _check_shapes(
    config: dict | None, source_dir, tensors: dict[str, StoredTensor], companions: dict, problems: list[str]
) -> None:
    """Every tensor's shape against the export's config.json, which the engines build the model
    from, and, where it says otherwise, against the source's."""
    specs = source_specs(config)
    if specs is not None:
        check_shapes(tensors, companions, specs, CONFIG, problems)
    if source_dir is None:
        return
    try:
        source_config = read_hf_config(source_dir)
    except EprtError:
        return  # said by the name check's --source line
    if specs is None or without_quantization(source_config) != without_quantization(config):
        # a family eprt does not model: the source's own shapes (eprt.hf.check_unmodeled)
        source_specs_ = source_specs(source_config) or source_shape_specs(source_dir)
        if source_specs_ is not None:
            check_shapes(tensors, companions, source_specs_, str(Path(source_dir, CONFIG)), problems)


def is_compressed_tensors(config: dict | None) -> bool:
    return (
        isinstance(config, dict)
        and isinstance(config.get("quantization_config"), dict)
        and config["quantization_config"].get("quant_method") == "compressed-tensors"
    )


def ct_formats(tensors: dict[str, StoredTensor]) -> dict[str, WeightFormat]:
    """Each quantized Linear of a compressed-tensors export -> its format, as its tensors say."""
    leaves: dict[str, set[str]] = {}
    for name in tensors:
        module, _, leaf = name.rpartition(".")
        leaves.setdefault(module, set()).add(leaf)
    return {m: fmt for m, ls in leaves.items() if (fmt := stored_format(m, ls, tensors)) is not None}


def _check_ct_scale_range(
    tensors: dict[str, StoredTensor], formats: dict[str, WeightFormat], kv: KvCacheFormat | None, problems: list[str]
) -> None:
    """The range checks of eprt.hf.check_scale_range on a compressed-tensors export: a format's
    scales stored as reciprocals (NVFP4's global scales) stand for them; the KV scales under the
    config's KV format `kv`. A scale missing, misshapen or not finite and positive, or a KV scale
    without a kv_cache_scheme eprt writes, is check_compressed_tensors' to name."""

    def scale(name: str, reciprocal: bool = False) -> Scale | None:
        t = tensors.get(name)
        ok = t is not None and t.dtype == "F32" and t.value is not None and math.isfinite(t.value) and t.value > 0
        return Scale(name, t.value, reciprocal) if ok else None

    for module, fmt in sorted(formats.items()):
        grid = tensors.get(f"{module}.{fmt.block_scale_leaf}") if fmt.block_scale_leaf else None
        weight, inputs = (
            scale(f"{module}.{leaf}", fmt.ct_reciprocal) if leaf else None for leaf in fmt.ct_per_tensor_scales
        )
        check_linear(
            module,
            fmt,
            weight,
            inputs,
            grid.block_range if grid else None,
            problems,
            grid=f"{module}.{fmt.block_scale_leaf}",
        )
    for name in sorted(tensors):
        if kv is not None and name.rpartition(".")[2] in KV_SCALES and (s := scale(name)) is not None:
            check_kv(s, kv, problems)


def _source_names(config: dict | None, source_dir, problems: list[str]):
    try:
        return source_names_from_dir(source_dir) if source_dir is not None else source_names_from_config(config)
    except EprtError as e:
        problems.append(f"--source: {e}")
        return None
