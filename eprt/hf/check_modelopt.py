"""The Linear-level checks of a ModelOpt-layout export: each quantized Linear's scales, the scales
the engines' fused modules share, and the exclusions against what each engine skips.

Each module's format comes from its weight's dtype (`WeightFormat.modelopt_weight_dtype`), or,
under MIXED_PRECISION, also from quantized_layers. The engines load Linears that read one input
as one fused weight (vLLM's packed_modules_mapping) and a layer's routed experts as one
`...experts` module: an unquantized Linear must be listed by exact name or a pattern (narrow
reading) and its fused name must be skipped too, while a quantized module must not be matched by
any engine's reading (broad reading, substrings included: eprt.hf.check_exclusions).
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict

from eprt.hf.check_exclusions import Exclusions
from eprt.hf.check_quant_config import MIXED
from eprt.hf.check_scale_range import Scale, check_linear, scalar_scale
from eprt.quant.formats import WEIGHT_FORMATS, WeightFormat, by_modelopt_weight_dtype, by_quant_algo
from eprt.storage.safetensors_io import dtype_name

FLOAT_DTYPES = ("BF16", "F16", "F32")
# The scale leaves of every format (all but the stored weight), and each format's leaves it does not write.
LINEAR_SCALES = {leaf for f in WEIGHT_FORMATS.values() for leaf in f.modelopt_leaves[1:]}
FOREIGN_LEAVES = {f: sorted(LINEAR_SCALES - set(f.modelopt_leaves)) for f in WEIGHT_FORMATS.values()}

# Linears that read one input and that vLLM loads as one fused weight (its packed_modules_mapping).
FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
}
FUSED_NAME = {shard: fused for fused, shards in FUSED.items() for shard in shards}
# Linears that must share input_scale and the per-tensor weight scale in a format that shares them
# (NVFP4's weight_scale_2): the fused ones, and gate/up of a routed expert, which the fused MoE loads
# as one weight with gate's weight scale (Kimi: w1/w3).
SAME_INPUT = (*FUSED.values(), ("w1", "w3"))
ROUTED_EXPERT = re.compile(r"^(?P<moe>.+\.experts)\.(?P<expert>\d+)\.(?P<kind>gate_proj|up_proj|down_proj|w1|w2|w3)$")


class ModelOptModules:
    """The Linear-level checks: scales, shapes, shared scales, exclusions."""

    def __init__(
        self, tensors: dict, algo: str, exclude: list[str], problems: list[str], layers: dict[str, str] | None = None
    ):
        """`tensors`: name -> header (eprt.hf.check_files.StoredTensor); `algo`: the export's quant_algo
        (one format's, or MIXED_PRECISION with each module's in `layers`)."""
        self.tensors = tensors
        self.algo = algo
        self.layers = layers  # MIXED_PRECISION: module (routed experts as `...experts`) -> quant_algo
        self.exclude = exclude
        self.exact = set(exclude)
        self.entries = Exclusions(exclude)
        self.problems = problems
        self.quantized: set[str] = set()
        self.format_of: dict[str, WeightFormat] = {}  # each quantized module's format, from its weight's dtype
        self.unquantized: set[str] = set()  # modules with a 2-D float weight, embeddings aside
        formats = list(WEIGHT_FORMATS.values()) if algo == MIXED else [by_quant_algo(algo)]
        stores = "/".join(sorted({f.modelopt_weight_dtype for f in formats}))
        for name, t in tensors.items():
            module, _, leaf = name.rpartition(".")
            if leaf != "weight" or len(t.shape) != 2:
                continue
            scale = tensors.get(f"{module}.weight_scale")
            # MIXED_PRECISION: the format quantized_layers declares first, where it stores this weight
            # (NVFP4 and NVFP4 weights only store the same tensors but input_scale)
            declared = by_quant_algo((layers or {}).get(m["moe"] if (m := ROUTED_EXPERT.match(module)) else module))
            among = [declared, *formats] if declared in formats else formats
            fmt = by_modelopt_weight_dtype(
                t.dtype,
                len(scale.shape) if scale is not None else None,
                among,
                scale.dtype if scale is not None else None,
            )
            if fmt is not None:
                self.quantized.add(module)
                self.format_of[module] = fmt
            elif t.dtype in FLOAT_DTYPES:
                if "embed_tokens" not in module:
                    self.unquantized.add(module)
            else:
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
        fmt = self.format_of[module]
        weight_scale, input_scale = (
            self._per_tensor(f"{module}.{leaf}") if leaf else None for leaf in fmt.modelopt_per_tensor_scales
        )
        grid = self.tensors.get(f"{module}.{fmt.block_scale_leaf}") if fmt.block_scale_leaf else None
        check_linear(
            module,
            fmt,
            weight_scale,
            input_scale,
            grid.block_range if grid else None,
            self.problems,
            grid=f"{module}.{fmt.block_scale_leaf}",
        )
        if fmt.block_scale_leaf:
            out, stored = weight.shape
            in_dim = fmt.in_dim_of_stored(stored)
            name = f"{module}.{fmt.block_scale_leaf}"
            dtype, shape = fmt.modelopt_tensors(out, in_dim)[fmt.block_scale_leaf]
            t = self.tensors.get(name)
            if fmt.unfit_input_dim(in_dim):
                self.problems.append(
                    f"{module}.weight: shape {list(weight.shape)} packs an input dim not a multiple of {fmt.group_size}"
                )
            elif t is None:
                self.problems.append(f"{name}: missing (block scales of quantized module {module})")
            elif t.dtype != dtype_name(dtype) or t.shape != shape:
                self.problems.append(
                    f"{name}: {t.dtype} {list(t.shape)}, expected {dtype_name(dtype)} {list(shape)} "
                    f"for weight {list(weight.shape)}"
                )
            elif t.bad_block_scales:
                self.problems.append(f"{name}: {t.bad_block_scales} block scale(s) zero, negative or NaN")
        for leaf in FOREIGN_LEAVES[fmt]:
            if f"{module}.{leaf}" in self.tensors:
                self.problems.append(f"{module}.{leaf}: not part of an {fmt.quant_algo} export")

    def _per_tensor(self, name: str) -> Scale | None:
        """The per-tensor scale `name`, or None when it is missing or refused (said in problems)."""
        t = self.tensors.get(name)
        if t is None:
            self.problems.append(f"{name}: missing (quantized module {name.rpartition('.')[0]})")
            return None
        return scalar_scale(name, t, self.problems)

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
        for fmt in WEIGHT_FORMATS.values():
            if fmt.shares_fused_scales:
                self._check_fused_agree(fmt, {m for m, f in self.format_of.items() if f is fmt})

    def _check_fused_agree(self, fmt: WeightFormat, modules: set[str]) -> None:
        """The `fmt` modules of a fused group agree on the per-tensor scales the engine keeps one of."""
        for parent in sorted({m.rpartition(".")[0] for m in modules}):
            for group in SAME_INPUT:
                members = [f"{parent}.{leaf}" for leaf in group if f"{parent}.{leaf}" in modules]
                for module in members[1:]:
                    for scale in filter(None, fmt.modelopt_per_tensor_scales):
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
                groups[fused][module] = self._algo(module)
        for fused, members in sorted(groups.items()):
            if len(set(members.values())) > 1:
                by = defaultdict(list)
                for m, a in sorted(members.items()):
                    by[a or "unquantized"].append(m)
                self.problems.append(
                    f"{fused}: loaded as one fused module but its members differ: "
                    + "; ".join(f"{a}: {ms}" for a, ms in sorted(by.items()))
                )

    def _algo(self, module: str) -> str | None:
        """`module`'s quant_algo, None where it is unquantized."""
        return self.format_of[module].quant_algo if module in self.format_of else None

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
            algo = self._algo(module)
            if algo != declared:
                self.problems.append(
                    f"{module}: stored {algo or 'unquantized'} but quantized_layers says "
                    f"{declared_as}: {declared or 'not listed (unquantized)'}"
                )
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
