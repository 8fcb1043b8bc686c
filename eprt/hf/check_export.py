"""Check a quantized Hugging Face export (docs/export.md) for what vLLM's and SGLang's modelopt
loaders rely on (a compressed-tensors export: eprt.hf.check_compressed_tensors).

`check_export(out_dir)` returns one line per violation, each naming the tensor, module or config
key at fault; an empty list means the export passed. Only headers and scale tensors are read,
never the quantized weights. What the checker passes, an engine loads, so beside the layout's own
rules: every file it reads lies inside the export (eprt.storage.paths), every tensor has the shape
config.json gives it (eprt.hf.check_shapes), and every scale survives the engines' fp32
arithmetic (eprt.hf.check_scale_range), in both layouts.

Exclusion matching follows the engines. vLLM skips a module when an exclude entry equals its name,
is a substring of it, or matches it as an fnmatch pattern (after splitting a pattern `X*` into `X`
and `X.*`); it asks for fused names (`qkv_proj`, `gate_up_proj`, `fused_qkv_a_proj`, and the
routed experts of a layer as one `...experts` module), not for the checkpoint's own. SGLang
matches exact names and `*` patterns. So an unquantized Linear must be listed by exact name or a
pattern (narrow reading) and its fused name must be skipped too, while a quantized module must
not be matched by any engine's reading (broad reading, substrings included).
"""

from __future__ import annotations

import functools
import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from fnmatch import fnmatchcase
from pathlib import Path

import torch
from safetensors import safe_open

from eprt.errors import CheckpointError, EprtError
from eprt.families import read_hf_config
from eprt.hf import compressed_tensors_export as ct
from eprt.hf import modelopt_layout as modelopt
from eprt.hf.check_names import (COMPANIONS, KV_COMPANIONS, check_names, source_names_from_config,
                                  source_names_from_dir)
from eprt.hf.check_quant_config import MIXED, NVFP4_GROUP, QUANTIZED_DTYPE, check_configs, quantized_layers
from eprt.hf.check_scale_range import Scale, check_kv, check_linear
from eprt.hf.check_shapes import check_shapes, source_specs
from eprt.storage.encodings import without_quantization
from eprt.storage.hf_files import CONFIG, INDEX, QUALITY, QUANT_CONFIG, SINGLE
from eprt.storage.paths import resolve_inside

ALGO_OF_DTYPE = {v: k for k, v in QUANTIZED_DTYPE.items()}
FLOAT_DTYPES = ("BF16", "F16", "F32")
# Per-tensor scales every quantized Linear carries (NVFP4's weight_scale is the block-scale grid).
PER_TENSOR_SCALES = {"FP8": ("weight_scale", "input_scale"), "NVFP4": ("weight_scale_2", "input_scale")}
LINEAR_SCALES = ("weight_scale", "weight_scale_2", "input_scale")
CT_SCALES = ("weight_global_scale", "input_global_scale")  # compressed-tensors' NVFP4 (reciprocal) scales
KV_SCALES = {"k_scale": "k_proj", "v_scale": "v_proj"}

# Linears that read one input and that vLLM loads as one fused weight (its packed_modules_mapping).
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
FUSED_NAME = {shard: fused for fused, shards in FUSED.items() for shard in shards}
# NVFP4 Linears that must share input_scale and weight_scale_2: the fused ones, and gate/up of a
# routed expert, which the fused MoE loads as w13 with gate's weight_scale_2 (Kimi: w1/w3).
SAME_INPUT = (*FUSED.values(), ("w1", "w3"))
ROUTED_EXPERT = re.compile(r"^(?P<moe>.+\.experts)\.(?P<expert>\d+)\.(?P<kind>gate_proj|up_proj|down_proj|w1|w2|w3)$")


@dataclass
class _Tensor:
    dtype: str  # safetensors spelling: F32, BF16, F8_E4M3, U8, ...
    shape: tuple[int, ...]
    value: float | None = None  # one-element scales: the value
    bad_block_scales: int = 0  # block-scale grids: how many are zero, negative or NaN
    block_range: tuple[float, float] | None = None  # block-scale grids: the smallest and largest valid scale


def check_export(out_dir, source_dir=None) -> list[str]:
    """Violations of the ModelOpt layout in the export at `out_dir`; empty when it passes.

    Every tensor must be one an engine loads (`eprt.hf.check_names`); with `source_dir` (the
    Hugging Face checkpoint the export was made from) the export's name set must be exactly the
    source's, each quantized Linear's weight replaced by its companions."""
    out = Path(out_dir)
    if not out.is_dir():
        return [f"{out}: not a directory"]
    problems: list[str] = []
    config = _read_json(out / CONFIG, problems)
    if (out / QUALITY).exists():  # the PTQ quality report: engines ignore it, but it must be what it says
        _read_json(out / QUALITY, problems)
    if is_compressed_tensors(config):
        from eprt.hf.check_compressed_tensors import check_compressed_tensors

        tensors = _read_tensors(out, problems)
        check_compressed_tensors(config, tensors, _source_names(config, source_dir, problems), problems)
        formats = _ct_formats(tensors)
        _check_ct_scale_range(tensors, formats, problems)
        _check_shapes(config, source_dir, tensors,
                      {m: functools.partial(ct.companions, f) for m, f in formats.items()}, problems)
        return problems
    hf_quant = _read_json(out / QUANT_CONFIG, problems)
    algo, kv_algo, exclude = check_configs(config, hf_quant, problems)
    tensors = _read_tensors(out, problems)
    if algo is not None and tensors:
        modules = _Modules(tensors, algo, exclude, problems,
                           quantized_layers(config, hf_quant) if algo == MIXED else None)
        modules.check()
        _check_kv_scales(tensors, kv_algo, modules.entries, problems)
        source = _source_names(config, source_dir, problems)
        check_names(tensors, {m: COMPANIONS[a] for m, a in modules.algo_of.items()}, KV_COMPANIONS if kv_algo else (),
                    source, problems)
        _check_shapes(config, source_dir, tensors,
                      {m: functools.partial(modelopt.companions, a.lower()) for m, a in modules.algo_of.items()},
                      problems)
    return problems


def _check_shapes(config: dict | None, source_dir, tensors: dict[str, _Tensor], companions: dict,
                  problems: list[str]) -> None:
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
        source_specs_ = source_specs(source_config)
        if source_specs_ is not None:
            check_shapes(tensors, companions, source_specs_, str(Path(source_dir, CONFIG)), problems)


def is_compressed_tensors(config: dict | None) -> bool:
    return isinstance(config, dict) and isinstance(config.get("quantization_config"), dict) \
        and config["quantization_config"].get("quant_method") == "compressed-tensors"


def _ct_formats(tensors: dict[str, _Tensor]) -> dict[str, str]:
    """Each quantized Linear of a compressed-tensors export -> its eprt format, as its tensors say."""
    formats = {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight_packed":
            formats[module] = "nvfp4"
        elif leaf == "weight" and t.dtype == "F8_E4M3":
            formats[module] = "fp8"
    return formats


def _check_ct_scale_range(tensors: dict[str, _Tensor], formats: dict[str, str], problems: list[str]) -> None:
    """The range checks of eprt.hf.check_scale_range on a compressed-tensors export: its NVFP4 global
    scales stand for their reciprocals. A scale missing, misshapen or not finite and positive is
    check_compressed_tensors' to name."""
    def scale(name: str, reciprocal: bool = False) -> Scale | None:
        t = tensors.get(name)
        ok = t is not None and t.dtype == "F32" and t.value is not None and math.isfinite(t.value) and t.value > 0
        return Scale(name, t.value, reciprocal) if ok else None

    for module, fmt in sorted(formats.items()):
        if fmt == "nvfp4":
            grid = tensors.get(f"{module}.weight_scale")
            check_linear(module, fmt, scale(f"{module}.weight_global_scale", True),
                         scale(f"{module}.input_global_scale", True), grid.block_range if grid else None, problems)
        else:
            check_linear(module, fmt, scale(f"{module}.weight_scale"), scale(f"{module}.input_scale"), None, problems)
    for name in sorted(tensors):
        if name.rpartition(".")[2] in KV_SCALES and (kv := scale(name)) is not None:
            check_kv(kv, problems)


def _source_names(config: dict | None, source_dir, problems: list[str]):
    try:
        return source_names_from_dir(source_dir) if source_dir is not None else source_names_from_config(config)
    except EprtError as e:
        problems.append(f"--source: {e}")
        return None


# ------------------------------------------------------------------------------------ files


def _read_json(path: Path, problems: list[str]) -> dict | None:
    if not path.exists():
        problems.append(f"{path.name}: missing")
        return None
    if not _inside(path.parent, path.name, path.name, problems):
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{path.name}: not readable JSON ({e})")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path.name}: not a JSON object")
        return None
    return data


def _read_tensors(out: Path, problems: list[str]) -> dict[str, _Tensor]:
    """Header of every tensor, and the values of the scales, from the shards the index names."""
    on_disk = sorted(p.name for p in out.glob("*.safetensors"))
    weight_map = None
    if (out / INDEX).exists():
        index = _read_json(out / INDEX, problems)
        weight_map = index.get("weight_map") if index else None
        if not isinstance(weight_map, dict):
            problems.append(f"{INDEX}: no weight_map object")
            return {}
        shards = _indexed_shards(out, weight_map, problems)
        named = {s for s in weight_map.values() if isinstance(s, str)}
        for name in on_disk:
            if name not in named:
                problems.append(f"{name}: shard not named in {INDEX} weight_map; engines load only indexed shards")
    elif (out / SINGLE).exists():
        shards = [SINGLE] if _inside(out, SINGLE, SINGLE, problems) else []
        for name in on_disk:
            if name != SINGLE:
                problems.append(f"{name}: shard beside {SINGLE} without {INDEX}")
    else:
        problems.append(f"{out}: neither {INDEX} nor {SINGLE}")
        return {}

    tensors: dict[str, _Tensor] = {}
    read = set()
    for shard in shards:
        if not (out / shard).exists():
            problems.append(f"{shard}: named in {INDEX} weight_map but missing")
            continue
        try:
            names = _read_shard(out / shard, tensors, problems)
        except Exception as e:  # a corrupt file may fail in many ways; name it and go on
            problems.append(f"{shard}: not a readable safetensors file ({e})")
            continue
        read.add(shard)
        if weight_map is not None:
            for name in names:
                mapped = weight_map.get(name)
                if name not in weight_map:
                    problems.append(f"{name}: in {shard} but not in {INDEX} weight_map")
                elif isinstance(mapped, str) and mapped != shard:  # not a file name: said above
                    problems.append(f"{name}: in {shard} but {INDEX} weight_map says {mapped}")
    if weight_map is not None:
        for name, shard in sorted(weight_map.items()):
            if name not in tensors and shard in read:
                problems.append(f"{name}: in {INDEX} weight_map but not in {shard}")
    return tensors


def _indexed_shards(out: Path, weight_map: dict, problems: list[str]) -> list[str]:
    """The shards the index names that an engine would read from inside the export: a name that is
    not a file name, or one that leaves the directory (`../x`, a link out), is refused and not read."""
    named = set()
    for name, shard in sorted(weight_map.items()):
        if isinstance(shard, str):
            named.add(shard)
        else:
            problems.append(f"{INDEX}: weight_map maps {name} to {shard!r}, not a shard's file name")
    return [s for s in sorted(named) if _inside(out, s, INDEX, problems)]


def _inside(out: Path, rel: str, where: str, problems: list[str]) -> bool:
    try:
        resolve_inside(str(out), rel, where)
    except CheckpointError as e:
        problems.append(str(e))
        return False
    return True


def _read_shard(path: Path, tensors: dict[str, _Tensor], problems: list[str]) -> list[str]:
    with safe_open(path, framework="pt") as f:
        names = list(f.keys())
        for name in names:
            if name in tensors:
                problems.append(f"{name}: stored twice (again in {path.name})")
                continue
            piece = f.get_slice(name)
            t = _Tensor(piece.get_dtype(), tuple(piece.get_shape()))
            leaf = name.rsplit(".", 1)[-1]
            if leaf in LINEAR_SCALES or leaf in KV_SCALES or leaf in CT_SCALES:
                if math.prod(t.shape) == 1:
                    t.value = f.get_tensor(name).float().item()
                elif t.dtype == "F8_E4M3":
                    raw = f.get_tensor(name).view(torch.uint8)
                    # 0x00/0x80 are zeros, 0x7F/0xFF NaN, and 0x80 upwards negative.
                    bad = (raw == 0) | (raw >= 0x7F)
                    t.bad_block_scales = int(bad.sum())
                    valid = raw[~bad] if t.bad_block_scales else raw
                    if valid.numel():  # positive E4M3 codes order as their values
                        codes = torch.stack([valid.min(), valid.max()]).view(torch.float8_e4m3fn).float()
                        t.block_range = (codes[0].item(), codes[1].item())
            tensors[name] = t
    return names


# ---------------------------------------------------------------------------------- modules


class _Modules:
    """The Linear-level checks: scales, shapes, shared scales, exclusions."""

    def __init__(self, tensors: dict[str, _Tensor], algo: str, exclude: list[str], problems: list[str],
                 layers: dict[str, str] | None = None):
        self.tensors = tensors
        self.algo = algo
        self.layers = layers  # MIXED_PRECISION: module (routed experts as `...experts`) -> quant_algo
        self.exclude = exclude
        self.exact = set(exclude)
        self.entries = _Exclusions(exclude)
        self.problems = problems
        self.quantized: set[str] = set()
        self.algo_of: dict[str, str] = {}  # each quantized module's format, from its weight's dtype
        self.unquantized: set[str] = set()  # modules with a 2-D float weight, embeddings aside
        for name, t in tensors.items():
            module, _, leaf = name.rpartition(".")
            if leaf != "weight" or len(t.shape) != 2:
                continue
            if t.dtype == QUANTIZED_DTYPE.get(algo) or (algo == MIXED and t.dtype in ALGO_OF_DTYPE):
                self.quantized.add(module)
                self.algo_of[module] = ALGO_OF_DTYPE[t.dtype]
            elif t.dtype in FLOAT_DTYPES:
                if "embed_tokens" not in module:
                    self.unquantized.add(module)
            else:
                stores = "/".join(ALGO_OF_DTYPE) if algo == MIXED else QUANTIZED_DTYPE[algo]
                problems.append(
                    f"{name}: dtype {t.dtype}; a {algo} export stores {stores} (quantized) "
                    f"or {'/'.join(FLOAT_DTYPES)} (excluded) Linear weights"
                )

    def check(self) -> None:
        for module in sorted(self.quantized):
            self._check_scales(module)
        self._check_stray_scales()
        self._check_shared_scales()
        self._check_expert_input_scales()
        self._check_mixed_precision()
        if self.layers is None:
            self._check_not_excluded()
            self._check_unquantized()
        else:
            self._check_declared()

    # -- scales of one quantized Linear

    def _check_scales(self, module: str) -> None:
        weight = self.tensors[f"{module}.weight"]
        algo = self.algo_of[module]
        weight_scale, input_scale = (self._per_tensor(f"{module}.{leaf}") for leaf in PER_TENSOR_SCALES[algo])
        grid = self.tensors.get(f"{module}.weight_scale") if algo == "NVFP4" else None
        check_linear(module, algo.lower(), weight_scale, input_scale, grid.block_range if grid else None,
                     self.problems)
        if algo == "NVFP4":
            out, packed = weight.shape
            name = f"{module}.weight_scale"
            t = self.tensors.get(name)
            if packed % (NVFP4_GROUP // 2) != 0:
                self.problems.append(
                    f"{module}.weight: shape {list(weight.shape)} packs an input dim not a multiple of {NVFP4_GROUP}"
                )
            elif t is None:
                self.problems.append(f"{name}: missing (block scales of quantized module {module})")
            elif t.dtype != "F8_E4M3" or t.shape != (out, packed * 2 // NVFP4_GROUP):
                self.problems.append(
                    f"{name}: {t.dtype} {list(t.shape)}, expected F8_E4M3 {[out, packed * 2 // NVFP4_GROUP]} "
                    f"for weight {list(weight.shape)}"
                )
            elif t.bad_block_scales:
                self.problems.append(f"{name}: {t.bad_block_scales} block scale(s) zero, negative or NaN")
        elif f"{module}.weight_scale_2" in self.tensors:
            self.problems.append(f"{module}.weight_scale_2: not part of an FP8 export")

    def _per_tensor(self, name: str) -> Scale | None:
        """The per-tensor scale `name`, or None when it is missing or refused (said in problems)."""
        t = self.tensors.get(name)
        if t is None:
            self.problems.append(f"{name}: missing (quantized module {name.rpartition('.')[0]})")
            return None
        return _scalar_scale(name, t, self.problems)

    def _check_stray_scales(self) -> None:
        for name in sorted(self.tensors):
            module, _, leaf = name.rpartition(".")
            if leaf not in LINEAR_SCALES or module in self.quantized:
                continue
            if self._listed(module) or self._skipped_by_any(module):
                self.problems.append(f"{name}: excluded module {module} carries a scale")
            else:
                self.problems.append(f"{name}: scale of {module}, which has no quantized weight")

    # -- scales that must agree

    def _value(self, name: str) -> float | None:
        t = self.tensors.get(name)
        return None if t is None else t.value

    def _check_shared_scales(self) -> None:
        nvfp4 = {m for m, a in self.algo_of.items() if a == "NVFP4"}
        for parent in sorted({m.rpartition(".")[0] for m in nvfp4}):
            for group in SAME_INPUT:
                members = [f"{parent}.{leaf}" for leaf in group if f"{parent}.{leaf}" in nvfp4]
                for module in members[1:]:
                    for scale in ("weight_scale_2", "input_scale"):
                        a, b = self._value(f"{members[0]}.{scale}"), self._value(f"{module}.{scale}")
                        if a is not None and b is not None and a != b:
                            self.problems.append(
                                f"{module}.{scale}: {b} differs from {members[0]}.{scale} {a}; "
                                f"{'/'.join(group)} read one input and are loaded fused with one {scale}"
                            )

    def _check_expert_input_scales(self) -> None:
        values: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
        for module in self.quantized:
            m = ROUTED_EXPERT.match(module)
            value = self._value(f"{module}.input_scale")
            if m and value is not None:
                values[m["moe"], m["kind"]][module] = value
        for (moe, kind), by_module in sorted(values.items()):
            common, _ = Counter(by_module.values()).most_common(1)[0]
            for module, value in sorted(by_module.items()):
                if value != common:
                    self.problems.append(
                        f"{module}.input_scale: {value}, other {kind} experts of {moe} have {common}; "
                        "the fused MoE loads one input_scale per projection kind"
                    )

    # -- exclusions

    def _check_mixed_precision(self) -> None:
        groups: dict[str, dict[str, bool]] = defaultdict(dict)
        for module in self.quantized | self.unquantized:
            fused = self._fused_name(module)
            if fused is not None:
                groups[fused][module] = self.algo_of.get(module)
        for fused, members in sorted(groups.items()):
            if len(set(members.values())) > 1:
                by = defaultdict(list)
                for m, a in sorted(members.items()):
                    by[a or "unquantized"].append(m)
                self.problems.append(
                    f"{fused}: loaded as one fused module but its members differ: "
                    + "; ".join(f"{a}: {ms}" for a, ms in sorted(by.items()))
                )

    def _fused_name(self, module: str) -> str | None:
        """The name vLLM loads `module` under: routed experts as their layer's `...experts`."""
        m = ROUTED_EXPERT.match(module)
        if m:
            return m["moe"]
        parent, _, leaf = module.rpartition(".")
        return f"{parent}.{FUSED_NAME[leaf]}" if leaf in FUSED_NAME else None

    def _check_declared(self) -> None:
        """MIXED_PRECISION: every quantized module listed in quantized_layers with its own quant_algo
        (routed experts under their layer's `...experts`), no unquantized one listed, no stale entry."""
        seen = set()
        for module in sorted(self.quantized | self.unquantized):
            m = ROUTED_EXPERT.match(module)
            declared_as = m["moe"] if m else module
            declared = self.layers.get(declared_as)
            seen.add(declared_as)
            algo = self.algo_of.get(module)
            if algo != declared:
                self.problems.append(
                    f"{module}: stored {algo or 'unquantized'} but quantized_layers says "
                    f"{declared_as}: {declared or 'not listed (unquantized)'}")
        for module in sorted(set(self.layers) - seen):
            self.problems.append(f"quantized_layers.{module}: no such Linear in the export")

    def _listed(self, name: str) -> bool:
        """Every engine finds `name` in the exclusions: an exact name or a `*` pattern."""
        return name in self.exact or bool(self.entries.split_matching(name))

    def _skipped_by_any(self, name: str) -> list[str]:
        """Exclude entries some engine would skip `name` for: exact, pattern or substring."""
        found = self.entries.inside(name) | self.entries.matching(name)
        return [e for e in self.exclude if e in found] if found else []

    def _vllm_skip_reason(self, fused: str) -> str | None:
        """Why vLLM would load the fused module `fused` unquantized, or None when it would not:
        every shard listed exactly, an entry naming an expert of the layer (routed experts), or
        an entry that is a substring of the fused name or a pattern matching it."""
        leaf = fused.rpartition(".")[2]
        if leaf == "experts" and fused in self.entries.expert_holders:
            return f"exclude entry {self.entries.expert_holders[fused]!r} names an expert of it"
        if leaf in FUSED:
            present = self._shards(fused)
            if present and all(s in self.exact for s in present):
                return f"every shard is listed ({present})"
        if inside := self.entries.inside(fused) - {fused}:
            return f"exclude entry {self.entries.first(inside)!r} is a substring of it"
        if matching := self.entries.split_matching(fused):
            return f"exclude entry {self.entries.first(matching)!r} matches it"
        return None

    def _shards(self, fused: str) -> list[str]:
        parent, _, leaf = fused.rpartition(".")
        return [f"{parent}.{s}" for s in FUSED[leaf] if f"{parent}.{s}.weight" in self.tensors]

    def _check_not_excluded(self) -> None:
        for module in sorted(self.quantized):
            for entry in self._skipped_by_any(module):
                if entry == module:
                    how = "listed in the exclusions"
                elif entry in module:
                    how = f"exclude entry {entry!r} is a substring of it, and vLLM matches substrings"
                else:
                    how = f"exclude pattern {entry!r} matches it"
                self.problems.append(f"{module}: quantized, but {how}; the engines would load it unquantized")
        fused_names = {self._fused_name(m) for m in self.quantized} - {None}
        for fused in sorted(fused_names):
            reason = self._vllm_skip_reason(fused)
            if reason is not None:
                self.problems.append(f"{fused}: holds quantized modules, but vLLM loads it unquantized: {reason}")

    def _check_unquantized(self) -> None:
        fused_members: dict[str, list[str]] = defaultdict(list)
        for module in sorted(self.unquantized):
            if not self._listed(module):
                self.problems.append(
                    f"{module}: unquantized Linear weight that no exclude entry lists by exact name or `*` pattern"
                )
                continue
            fused = self._fused_name(module)
            if fused is not None:
                fused_members[fused].append(module)
        quantized_fused = {self._fused_name(m) for m in self.quantized}
        for fused, members in sorted(fused_members.items()):
            if fused in quantized_fused:
                continue  # mixed precision, reported on its own
            if fused.rpartition(".")[2] in FUSED:
                listed = [s for s in self._shards(fused) if s in self.exact]
                if listed and len(listed) != len(self._shards(fused)):
                    self.problems.append(
                        f"{fused}: exclusions name {listed} exactly but not "
                        f"{sorted(set(self._shards(fused)) - set(listed))}; vLLM refuses a fused module listed in part"
                    )
                    continue
            if self._vllm_skip_reason(fused) is None:
                self.problems.append(
                    f"{fused}: vLLM loads {members} as this one module, which no exclude entry skips; "
                    "list every shard by exact name, or add an entry matching the fused name"
                )


class _Exclusions:
    """The exclude entries, looked up at a cost that does not grow with their number (an export
    lists one router pattern per layer): literal entries and prefix wildcards `P*` by the lengths
    they come in, only the other patterns one by one with fnmatch. Each method returns entries."""

    def __init__(self, entries: list[str]):
        self.order = {}
        for i, e in enumerate(entries):
            self.order.setdefault(e, i)
        self.literal = {e for e in self.order if not _MAGIC.search(e)}
        prefixed = {e for e in self.order if e.endswith("*") and not _MAGIC.search(e[:-1])}
        self.prefixed = _Prefixes([(e[:-1], e) for e in prefixed])
        self.patterns = [e for e in self.order if e not in self.literal and e not in prefixed]
        self.literal_lengths = sorted({len(e) for e in self.literal})
        # vLLM's reading: a pattern `X*` (not `X.*`) is rewritten as `X` and `X.*`
        self.split_exact = {e[:-1]: e for e in prefixed if len(e) >= 2 and e[-2] != "."}
        self.split_prefixed = _Prefixes([(e[:-1] + "." if e[:-1] in self.split_exact else e[:-1], e) for e in prefixed])
        self.split_patterns = [(e, p) for e in self.patterns
                               for p in ((e[:-1], e[:-1] + ".*") if len(e) >= 2 and e[-1] == "*" and e[-2] != "."
                                         else (e,))]

    def first(self, found: set[str]) -> str:
        return min(found, key=self.order.__getitem__)

    def inside(self, name: str) -> set[str]:
        """The entries that are substrings of `name` (vLLM's reading)."""
        found = {name[i:i + n] for n in self.literal_lengths for i in range(len(name) - n + 1)} & self.literal
        if _MAGIC.search(name):  # a wildcard entry is a substring only of a name holding its wildcard
            found |= {e for e in self.order if e not in self.literal and e in name}
        return found

    def matching(self, name: str) -> set[str]:
        """The entries `name` matches as fnmatch patterns (SGLang's reading; a literal: equal)."""
        return ({name} & self.literal) | self.prefixed.of(name) | {
            e for e in self.patterns if fnmatchcase(name, e)}

    def split_matching(self, name: str) -> set[str]:
        """The entries `name` matches after vLLM splits each `X*` into `X` and `X.*`."""
        return ({name} & self.literal) | ({self.split_exact[name]} if name in self.split_exact else set()) | self.split_prefixed.of(name) | {
            e for e, p in self.split_patterns if fnmatchcase(name, p)}

    @functools.cached_property
    def expert_holders(self) -> dict[str, str]:
        """Each name ending in `experts` that some entry holds -> the first such entry."""
        holders = {}
        for e in self.order:
            for m in re.finditer("experts", e):
                for i in range(m.start() + 1):
                    holders.setdefault(e[i:m.end()], e)
        return holders


_MAGIC = re.compile(r"[*?\[]")


class _Prefixes:
    """Entries that match the names starting with their prefix, found by the prefix lengths there are.
    Two entries may share a prefix (vLLM reads `X*` and `X.*` both as `X.*`)."""

    def __init__(self, pairs: list[tuple[str, str]]):
        self.by_prefix: dict[str, set[str]] = defaultdict(set)
        for p, e in pairs:
            self.by_prefix[p].add(e)
        self.lengths = sorted({len(p) for p in self.by_prefix})

    def of(self, name: str) -> set[str]:
        return {e for n in self.lengths if name[:n] in self.by_prefix for e in self.by_prefix[name[:n]]}


# ------------------------------------------------------------------------------- KV cache


# Vision towers attend without a KV cache; vLLM's modelopt loader names them so.
VISION_PREFIXES = ("vision_tower.", "vision_model.", "visual.")


def _check_kv_scales(tensors: dict[str, _Tensor], kv_algo: str | None, exclude: _Exclusions,
                     problems: list[str]) -> None:
    """k_scale/v_scale on every attention layer with a KV cache when kv_cache_quant_algo is FP8.

    A layer excluded whole by a pattern (DeepSeek-V3's multi-token-prediction layer,
    `model.layers.61.*`) is outside the quantized model and needs none."""
    attention = set()
    linear_attention = set()
    for name in tensors:
        head, sep, rest = name.partition(".self_attn.")
        if sep and not name.startswith(VISION_PREFIXES):
            attention.add(head + ".self_attn")
            if rest == "A_log":  # KDA keeps a recurrent state, not a KV cache
                linear_attention.add(head + ".self_attn")
    attention -= linear_attention
    for name in sorted(tensors):
        module, _, leaf = name.rpartition(".")
        if leaf not in KV_SCALES:
            continue
        if kv_algo is None:
            problems.append(f"{name}: KV-cache scale in an export without kv_cache_quant_algo")
        elif module.rpartition(".")[0] not in attention or not module.endswith(f".{KV_SCALES[leaf]}"):
            problems.append(f"{name}: not on an attention layer's self_attn.{KV_SCALES[leaf]}")
    if kv_algo != "FP8":
        return
    for attn in sorted(attention):
        if any("*" in e for e in exclude.matching(attn)):
            continue
        for leaf, proj in KV_SCALES.items():
            name = f"{attn}.{proj}.{leaf}"
            t = tensors.get(name)
            if t is None:
                problems.append(f"{name}: missing; kv_cache_quant_algo is FP8")
            elif (scale := _scalar_scale(name, t, problems)) is not None:
                check_kv(scale, problems)


def _scalar_scale(name: str, t: _Tensor, problems: list[str]) -> Scale | None:
    """A per-tensor scale: 0-dim fp32, finite and positive (engines divide by it and invert it);
    None, said in problems, when it is not."""
    if t.dtype != "F32" or t.shape != ():
        problems.append(f"{name}: {t.dtype} {list(t.shape)}, expected a 0-dim F32 scale")
    elif not (math.isfinite(t.value) and t.value > 0):
        problems.append(f"{name}: {t.value}, a scale must be finite and positive")
    else:
        return Scale(name, t.value)
    return None
