"""PTQ recipes: which modules get which format, by glob patterns over module names.

A recipe is a YAML file (eprt/configs/ptq/NAME.yaml, or any path):

    name: nvfp4_experts_only
    quantize:                      # the first pattern that matches a module decides
      - {pattern: "*.experts", format: nvfp4, algorithm: mse}
      - {pattern: "*.mlp.*", format: int4, group_size: 32}
      - {pattern: "*", format: none}
    kv_cache: null                 # or fp8 (eprt.quant.formats.kv)
    mtp: false                     # true: the rules quantize the multi-token-prediction layers too
    scale_headroom: false          # true: NVFP4's mse weights under a per-tensor scale with headroom
    act_headroom: false            # true: NVFP4 input scales with headroom (ModelOpt's nvfp4_act_headroom)
    ignore: ["lm_head", "*.gate"]  # optional: modules left unquantized whatever the rules say

Different patterns may give different formats (mixed precision: NVFP4 experts, FP8 attention).
Module names are the Hugging Face module names (`model.layers.3.self_attn.q_proj`); a MoE
layer's routed experts are one module (`model.layers.3.mlp.experts`). A family whose attention is
named otherwise gives it its `self_attn` name too (Nemotron-H's `backbone.layers.3.mixer.q_proj` is
also `backbone.layers.3.self_attn.q_proj`, DeepSeek-V4's `model.layers.3.attn.wq_a` also
`model.layers.3.self_attn.wq_a`: eprt.families.recipe_names), so `*.self_attn.*` means the
attention in every family. Whatever a recipe says, a family's never-quantized modules (embeddings,
lm_head, routers, ...) stay unquantized.

A rule's `group_size` picks a grouped format's groups along the input dim (INT4: 128, its default,
or 32, as `format: int4_g32` also names it); the rule then holds that format's registered name.
A rule's `grid` picks INT4's grid (eprt.quant.formats.int4; `int4`, `int4_g32`, `w4a8`): `kimi`, the
Kimi releases' codes -7..7 at about amax / 7 (formats `int4`, `int4_g32`, `w4a8`), or `full`,
compressed-tensors' own -8..7 at about amax / 7.5 (`int4_full`, `int4_g32_full`, `w4a8_full`, as
`format:` also names them). A rule that names neither takes its source's grid where the recipe
meets the source (`Recipe.on_source`, eprt.quant.source_grid: `kimi` for a Kimi release stored in
INT4, `full` for any other); until then, and read back from a calibrated checkpoint (whose recorded
formats name the grid chosen), a format is the one it names.

A rule's `algorithm` is how its weight scales are chosen (docs/export.md, 'Weight scales'): a
registered algorithm or a sequence of them, a balance then a rounding, with parameters
(eprt.quant.algorithms.registry: `max`, `mse`, `gptq`, `awq`, `awq+gptq` or `[awq, gptq]`,
`{gptq: {damp: 0.02}}`). A rule that names none takes eprt-ptq's `--algorithm` (default max); the
calibrated checkpoint records every rule's.
`rotate` in front of any of them (`rotate`, `rotate+mse`, `rotate+gptq`, `rotate+awq`,
`rotate+awq+gptq`; in a rule also as a list, `[rotate, gptq]`) first rotates the residual stream and
each head's values by randomised Hadamard matrices fused into the weights (eprt.quant.rotation),
then chooses the scales as the rest says (`rotate` alone: max). The rotation is the whole model's:
every rule that quantizes names it, or none does.

`ignore` names modules (globs) no rule quantizes; the model-free export (eprt.hf.streaming), which
has no family table of never-quantized modules, takes it in place of its default list.

The multi-token-prediction layers (DeepSeek-V3's `model.layers.{num_hidden_layers + k}`, Nemotron-H's
`mtp.layers.K`) are
carried through unquantized unless the recipe says `mtp: true`: then the same rules, first match
wins, decide their modules' formats too (eprt.quant.feasibility).

`experts_storage: {transposed: true, interleaved: true}` says how a checkpoint eprt does not model
stores its 3-D stacks of routed experts, for the model-free export (eprt.hf.streaming.selection):
`transposed`, [experts, in, out] (transformers' GPT-OSS and Llama-4) where `false` is [experts, out,
in] (left out: told by each layer's stacks' shapes against `hidden_size`, which a square stack cannot
tell); `interleaved`, gate and up alternating along a fused `gate_up_proj`'s outputs (GPT-OSS) where
`false`, the default, is gate then up (transformers' `is_concatenated`). A family eprt models says
it in its own table, and refuses the key.

`scale_headroom: true` (ModelOpt's "four over six") gives an NVFP4 weight whose scales `mse` searches
the per-tensor scale amax / (6 x 256) in place of amax / (6 x 448): a block scale code may then exceed
the tensor's largest block's by up to 448 / 256, so every block, the largest too, can map its amax to
the finer E2M1 grid of 4 instead of 6 where that has the smaller error; the mse search chooses per block
among all the E4M3 codes (eprt.quant.formats.nvfp4). Other formats and algorithms do not read it.

`act_headroom: true` (or a mapping of `anchor_percentile`, `upper_percentile`, `rho`: ModelOpt's
`nvfp4_act_headroom` settings) calibrates the input scale of every module whose inputs NVFP4
quantizes (W4A4) from the distribution of its inputs' block amax, with headroom above them
(eprt.quant.act_headroom); other formats' inputs keep max's.
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass, replace
from typing import NamedTuple

import yaml

from eprt.errors import ConfigError
from eprt.families import recipe_names
from eprt.quant.act_headroom import ActHeadroom, parse_act_headroom
from eprt.quant.algorithms.registry import DEFAULT, Params, parse_algorithm, rotated, rounding, steps, unrotated
from eprt.quant.algorithms.registry import sequences as algorithm_sequences
from eprt.quant.formats import WEIGHT_FORMATS, group_sizes, with_grid, with_group_size
from eprt.quant.formats.int4 import GRIDS, KIMI
from eprt.quant.formats.kv import KV_CACHE_FORMATS

# Shipped inside the package (package data), so an installed eprt finds them wherever it runs.
RECIPE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "ptq")
FORMATS = (*WEIGHT_FORMATS, "none")
KV_FORMATS = (None, *KV_CACHE_FORMATS)
RECIPE_KEYS = ("name", "quantize", "kv_cache", "mtp", "scale_headroom", "act_headroom", "ignore", "experts_storage")
# How a rule's weight scales are chosen (eprt.quant.algorithms.registry): the first is the default.
ALGORITHMS = algorithm_sequences()
RULE_KEYS = ("pattern", "format", "algorithm", "group_size", "grid")
REQUIRED_RULE_KEYS = ("pattern", "format")


@dataclass(frozen=True)
class ExpertsStorage:
    """How a checkpoint eprt does not model stores its stacks of routed experts (`experts_storage:`)."""

    transposed: bool | None = None  # [experts, in, out]; None: told by the shapes
    interleaved: bool = False  # a fused gate_up_proj's gate and up alternate along its outputs

    def to_json(self) -> dict:
        return {
            **({"transposed": self.transposed} if self.transposed is not None else {}),
            "interleaved": self.interleaved,
        }


def parse_experts_storage(d, source: str) -> ExpertsStorage | None:
    if d is None:
        return None
    keys = ("transposed", "interleaved")
    if not isinstance(d, dict) or not d or not all(k in keys and isinstance(v, bool) for k, v in d.items()):
        raise ConfigError(
            f"{source}: experts_storage {d!r:.80}: write a mapping of transposed: true|false (the stacks of "
            "experts stored [experts, in, out]) and interleaved: true|false (gate and up alternating along a "
            "fused gate_up_proj's outputs), or leave it out"
        )
    return ExpertsStorage(d.get("transposed"), d.get("interleaved", False))


class Rule(NamedTuple):
    pattern: str  # a glob over module names
    format: str  # one of FORMATS: a weight format's name (eprt.quant.formats) or none
    algorithm: str  # one of ALGORITHMS
    params: Params = ()  # the algorithms' parameters the rule sets apart from their defaults
    grid: str | None = None  # the INT4 grid the rule names (`grid:`, or a format named by it); None: the source's


@dataclass(frozen=True)
class Recipe:
    name: str
    rules: tuple[Rule, ...]
    kv_cache: str | None
    mtp: bool = False  # the rules apply to the multi-token-prediction layers too
    scale_headroom: bool = False  # NVFP4's mse weights under the per-tensor scale with headroom
    # globs of modules left unquantized whatever the rules say; None: none named. The model-free
    # export (eprt.hf.streaming) takes them in place of its default list of modules it leaves alone.
    ignore: tuple[str, ...] | None = None
    act_headroom: ActHeadroom | None = None  # NVFP4 input scales with headroom; None: max's
    # how a checkpoint eprt does not model stores its stacks of experts; None: told by their shapes
    experts_storage: ExpertsStorage | None = None

    def ignores(self, module: str) -> bool:
        return any(matches(module, p) for p in self.ignore or ())

    def rule_of(self, module: str) -> Rule | None:
        """The first rule whose pattern matches `module`, or None (also where `ignore` names it)."""
        if self.ignores(module):
            return None
        return next((r for r in self.rules if matches(module, r.pattern)), None)

    def format_of(self, module: str) -> str | None:
        rule = self.rule_of(module)
        return None if rule is None or rule.format == "none" else rule.format

    def algorithm_of(self, module: str) -> str | None:
        """How `module`'s weight scales are chosen on the weights as the run reads them (its sequence
        without the rotation, which is the whole model's: `rotates`); None where it is not quantized."""
        return unrotated(self.rule_of(module).algorithm) if self.format_of(module) else None

    def rounding_of(self, module: str) -> str | None:
        """How `module`'s scaled weight is rounded: the last algorithm of its sequence."""
        algorithm = self.algorithm_of(module)
        return None if algorithm is None else rounding(algorithm)

    def runs(self, module: str, algorithm: str) -> bool:
        """Whether `module`'s sequence runs `algorithm` (a balance alone rounds as the default does)."""
        sequence = self.algorithm_of(module)
        return sequence is not None and algorithm in steps(sequence)

    def params_of(self, module: str) -> Params:
        """The parameters `module`'s rule sets apart from their defaults."""
        return self.rule_of(module).params if self.format_of(module) else ()

    @property
    def formats(self) -> list[str]:
        """The quantized formats the recipe uses: more than one makes a mixed-precision export."""
        return sorted({r.format for r in self.rules} - {"none"})

    @property
    def algorithms(self) -> list[str]:
        """The algorithms of the rules that quantize, their rotation left out (`rotates`)."""
        return sorted({unrotated(r.algorithm) for r in self.rules if r.format != "none"})

    @property
    def roundings(self) -> list[str]:
        """How the rules that quantize round their weights (`rounding_of`)."""
        return sorted({rounding(a) for a in self.algorithms})

    @property
    def rotates(self) -> bool:
        """Whether the model's weights are read rotated (eprt.quant.rotation): every quantizing rule says so."""
        return any(rotated(r.algorithm) for r in self.rules if r.format != "none")

    def on_source(self, int4_grid: str) -> Recipe:
        """The recipe for a source whose INT4 grid is `int4_grid` (eprt.quant.source_grid): each rule
        that names no grid takes it where its format has one."""
        return replace(self, rules=tuple(rule_on_source(r, int4_grid) for r in self.rules))

    def to_json(self) -> dict:
        out = {"name": self.name, "quantize": [rule_json(r) for r in self.rules], "kv_cache": self.kv_cache}
        # written only when set, so a recipe without it reads back (and pins) as before
        return {
            **out,
            **({"mtp": True} if self.mtp else {}),
            **({"scale_headroom": True} if self.scale_headroom else {}),
            **({"ignore": list(self.ignore)} if self.ignore is not None else {}),
            **({"act_headroom": self.act_headroom.to_json()} if self.act_headroom is not None else {}),
            **({"experts_storage": self.experts_storage.to_json()} if self.experts_storage is not None else {}),
        }


def matches(module: str, pattern: str) -> bool:
    """Whether glob `pattern` matches `module` by its name or by another name its family gives it
    (eprt.families.recipe_names: Nemotron-H's attention `mixer.q_proj` is also `self_attn.q_proj`)."""
    return any(fnmatch.fnmatchcase(name, pattern) for name in recipe_names(module))


def named_grid(fmt: str, explicit: bool) -> str | None:
    """The grid a rule of format `fmt` names: its `grid:` (`explicit`), or one its format's name says
    (`int4_full`); None where it follows the source, or has no grid."""
    grid = getattr(WEIGHT_FORMATS.get(fmt), "grid", None)
    return grid.name if grid is not None and (explicit or grid is not KIMI) else None


def rule_on_source(r: Rule, int4_grid: str) -> Rule:
    """Rule r on the source's INT4 grid where it names none and its format has one."""
    found = with_grid(r.format, int4_grid) if r.grid is None and r.format != "none" else None
    return r if found is None else r._replace(format=found.name, grid=int4_grid)


def rule_json(r: Rule) -> dict:
    """A rule as parse_recipe reads it back; its parameters, where it sets any, in its algorithm."""
    params = dict(r.params)
    algorithm = [{n: dict(params[n])} if n in params else n for n in r.algorithm.split("+")] if params else r.algorithm
    return {"pattern": r.pattern, "format": r.format, "algorithm": algorithm}


def available() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(RECIPE_DIR) if f.endswith(".yaml"))


def refuse_unknown_keys(d: dict, valid: tuple[str, ...], where: str) -> None:
    """A misspelt key would silently mean its default: name it and the keys that exist."""
    unknown = [k for k in d if k not in valid]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; the valid keys are {', '.join(valid)}")


def grouped(fmt: str, group_size, where: str) -> str:
    """The registered name of format `fmt` in groups of `group_size` (a rule's `group_size:`)."""
    sizes = group_sizes(fmt) if fmt != "none" else []
    if not sizes:
        raise ConfigError(f"{where} group_size: format {fmt!r} has no groups to size; drop group_size from the rule")
    found = (
        with_group_size(fmt, group_size) if isinstance(group_size, int) and not isinstance(group_size, bool) else None
    )
    if found is None:
        raise ConfigError(
            f"{where} group_size {group_size!r}: {fmt} comes in groups of {' or '.join(map(str, sizes))}; choose one"
        )
    named, base = WEIGHT_FORMATS[fmt], kind_default(fmt)
    if named is not base and found is not named:  # `int4_g32` says its groups already
        raise ConfigError(
            f"{where} group_size {group_size}: format {fmt!r} is {base.name} in groups of {named.group_size}, "
            f"so the rule asks for two group sizes; drop group_size, or write format: {base.name}, "
            f"group_size: {group_size}"
        )
    return found.name


def kind_default(fmt: str):
    """The format of `fmt`'s kind that names no group size (`int4` of `int4_g32`): the first registered."""
    return next(f for f in WEIGHT_FORMATS.values() if f.kind == WEIGHT_FORMATS[fmt].kind)


def on_grid(fmt: str, grid, where: str) -> str:
    """The registered name of INT4 format `fmt` on grid `grid` (a rule's `grid:`)."""
    found = with_grid(fmt, grid) if fmt != "none" and isinstance(grid, str) else None
    if found is None:
        if fmt == "none" or with_grid(fmt, "kimi") is None:
            raise ConfigError(f"{where} grid: format {fmt!r} has no INT4 grid to choose; drop grid from the rule")
        offered = [g for g in GRIDS if with_grid(fmt, g) is not None]
        raise ConfigError(f"{where} grid {grid!r}: {fmt} comes on the {' or '.join(offered)} grid; choose one")
    named = WEIGHT_FORMATS[fmt]
    if named.grid != KIMI and named.grid.name != grid:  # `int4_full` says its grid already
        raise ConfigError(
            f"{where} grid {grid}: format {fmt!r} is on the {named.grid.name} grid, so the rule asks for two "
            "grids; drop grid, or name the format without it"
        )
    return found.name


def parse_recipe(d: dict, source: str, kv_cache: str | None = None, algorithm: str | None = None) -> Recipe:
    """`algorithm`: what a rule that names none gets (default ALGORITHMS[0])."""
    default, default_params = parse_algorithm(DEFAULT if algorithm is None else algorithm, "--algorithm")
    if isinstance(d, dict):
        refuse_unknown_keys(d, RECIPE_KEYS, source)
    if not isinstance(d, dict) or not isinstance(d.get("quantize"), list) or not d["quantize"]:
        raise ConfigError(f"{source}: a recipe needs a non-empty `quantize` list of {{pattern, format}}")
    rules = []
    for i, r in enumerate(d["quantize"]):
        if isinstance(r, dict):
            refuse_unknown_keys(r, RULE_KEYS, f"{source}: quantize[{i}]")
        if not isinstance(r, dict) or not set(REQUIRED_RULE_KEYS) <= set(r):
            raise ConfigError(
                f"{source}: quantize[{i}] must be {{pattern: GLOB, format: {'|'.join(FORMATS)}"
                f"[, algorithm: {'|'.join(ALGORITHMS)}][, group_size: N]}}"
            )
        if r["format"] not in FORMATS:
            raise ConfigError(f"{source}: quantize[{i}] format {r['format']!r}; choose one of {', '.join(FORMATS)}")
        sequence, params = (
            parse_algorithm(r["algorithm"], f"{source}: quantize[{i}] algorithm")
            if "algorithm" in r
            else (default, default_params)
        )
        fmt = grouped(r["format"], r["group_size"], f"{source}: quantize[{i}]") if "group_size" in r else r["format"]
        fmt = on_grid(fmt, r["grid"], f"{source}: quantize[{i}]") if "grid" in r else fmt
        rules.append(Rule(str(r["pattern"]), fmt, sequence, params, named_grid(fmt, "grid" in r)))
    if not {r.format for r in rules} - {"none"}:
        raise ConfigError(
            f"{source}: a recipe quantizes with at least one format, found none; "
            f"give a rule a format of {', '.join(FORMATS[:-1])}"
        )
    quantizing = [r for r in rules if r.format != "none"]
    if len({rotated(r.algorithm) for r in quantizing}) > 1:
        first = next(r for r in quantizing if rotated(r.algorithm))
        other = next(r for r in quantizing if not rotated(r.algorithm))
        raise ConfigError(
            f"{source}: rule {first.pattern!r} rotates ({first.algorithm}) and rule {other.pattern!r} does not "
            f"({other.algorithm}); the rotation is the whole model's: give every quantizing rule rotate, or none"
        )
    kv = kv_cache if kv_cache is not None else d.get("kv_cache")
    if kv not in KV_FORMATS:
        raise ConfigError(f"{source}: kv_cache {kv!r}; choose {' or '.join(KV_FORMATS[1:])} or null")
    mtp = d.get("mtp", False)
    if not isinstance(mtp, bool):
        raise ConfigError(
            f"{source}: mtp {mtp!r}; write true (quantize the multi-token-prediction layers by the same "
            "rules) or false (carry them through unquantized, the default)"
        )
    headroom = d.get("scale_headroom", False)
    if not isinstance(headroom, bool):
        raise ConfigError(
            f"{source}: scale_headroom {headroom!r}; write true (NVFP4's mse weights under amax / (6 x 256)) "
            "or false (amax / (6 x 448), the default)"
        )
    ignore = d.get("ignore")
    if ignore is not None and (not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore)):
        raise ConfigError(
            f"{source}: ignore {ignore!r:.80}: write a list of module-name globs left unquantized "
            '(e.g. ["lm_head", "*.mlp.gate"]), or leave it out'
        )
    name = d.get("name", os.path.basename(source))
    if not isinstance(name, str):
        raise ConfigError(f"{source}: name {name!r:.80} is not a string; name the recipe in plain text")
    act_headroom = parse_act_headroom(d.get("act_headroom"), source)
    storage = parse_experts_storage(d.get("experts_storage"), source)
    ignored = tuple(ignore) if ignore is not None else None
    return Recipe(name, tuple(rules), kv, mtp, headroom, ignored, act_headroom, storage)


def load_recipe(spec: str, kv_cache: str | None = None, algorithm: str | None = None) -> Recipe:
    """A recipe by name (eprt/configs/ptq/NAME.yaml) or by path."""
    path = spec if os.path.isfile(spec) else os.path.join(RECIPE_DIR, f"{spec}.yaml")
    if not os.path.isfile(path):
        raise ConfigError(
            f"--recipe {spec!r}: no such recipe; choose one of {', '.join(available())} or give a YAML path"
        )
    with open(path, "rb") as f:
        return parse_recipe(read_yaml(f, path), path, kv_cache, algorithm)


class PlainYAMLLoader(yaml.SafeLoader):
    """safe_load without aliases: `*name` repeats a node without copying it, so a few hundred
    bytes of nested aliases stand for a structure of billions of entries that anything walking
    it (a str(), a comparison) would then build. A recipe has no use for them. Nor for a key
    given twice in one mapping, which YAML resolves silently to the last value."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                f"{self.name}:{event.start_mark.line + 1}: the YAML alias *{event.anchor} is not "
                "allowed in a recipe; write the value out"
            )
        return super().compose_node(parent, index)

    def construct_mapping(self, node, deep=False):
        """A mapping whose key appears twice is refused: YAML would keep the last value without a word."""
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise ConfigError(
                    f"{self.name}:{key_node.start_mark.line + 1}: the key {key!r} appears twice in one "
                    f"mapping (first on line {seen[key] + 1}); keep one"
                )
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def read_yaml(stream, path: str):
    """The YAML document of `stream` (the file `path`), without aliases, refused by name when it
    is not YAML."""
    loader = PlainYAMLLoader(stream)
    loader.name = path
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML ({e})") from None
    except RecursionError:
        raise ConfigError(
            f"{path}: nested too deeply to be a recipe (thousands of levels of lists or "
            "mappings); write it as a list of {pattern, format} rules"
        ) from None
    finally:
        loader.dispose()
