"""PTQ recipes: which modules get which format, by glob patterns over module names.

A recipe is a YAML file (eprt/configs/ptq/NAME.yaml, or any path):

    name: nvfp4_experts_only
    quantize:                      # the first pattern that matches a module decides
      - {pattern: "*.experts", format: nvfp4, algorithm: mse}
      - {pattern: "*.mlp.*", format: int4, group_size: 32}
      - {pattern: "*", format: none}
    kv_cache: null                 # or fp8 (eprt.quant.formats.kv)
    mtp: false                     # true: the rules quantize the multi-token-prediction layers too
    ignore: ["lm_head", "*.gate"]  # optional: modules left unquantized whatever the rules say

Different patterns may give different formats (mixed precision: NVFP4 experts, FP8 attention).
Module names are the Hugging Face module names (`model.layers.3.self_attn.q_proj`); a MoE
layer's routed experts are one module (`model.layers.3.mlp.experts`). Whatever a recipe says,
a family's never-quantized modules (embeddings, lm_head, routers, ...) stay unquantized.

A rule's `group_size` picks a grouped format's groups along the input dim (INT4: 128, its default,
or 32, as `format: int4_g32` also names it); the rule then holds that format's registered name.

A rule's `algorithm` is how its weight scales are chosen (docs/export.md, 'Weight scales'):
`max` (from the weight's amax), `mse` (a search for the least squared quantization error), `gptq`
(GPTQ's rounding), or `awq` / `awq+gptq`: AWQ's per-input-channel scales folded into what precedes
the module (eprt.quant.passes.awq), then max's or GPTQ's rounding of the scaled weight. AWQ balances
a group of Linears that read one norm's output together: a group is balanced when every module of it
the recipe quantizes says `awq` or `awq+gptq`.
A rule that names none takes eprt-ptq's `--algorithm` (default max); the calibrated checkpoint
records every rule's.

`ignore` names modules (globs) no rule quantizes; the model-free export (eprt.hf.streaming), which
has no family table of never-quantized modules, takes it in place of its default list.

The multi-token-prediction layers (DeepSeek-V3's `model.layers.{num_hidden_layers + k}`) are
carried through unquantized unless the recipe says `mtp: true`: then the same rules, first match
wins, decide their modules' formats too (eprt.quant.feasibility).
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass
from typing import NamedTuple

import yaml

from eprt.errors import ConfigError
from eprt.quant.formats import WEIGHT_FORMATS, group_sizes, with_group_size
from eprt.quant.formats.kv import KV_CACHE_FORMATS

# Shipped inside the package (package data), so an installed eprt finds them wherever it runs.
RECIPE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "ptq")
FORMATS = (*WEIGHT_FORMATS, "none")
KV_FORMATS = (None, *KV_CACHE_FORMATS)
RECIPE_KEYS = ("name", "quantize", "kv_cache", "mtp", "ignore")
# How a rule's weight scales are chosen (eprt.quant.scales): the first is the default.
ALGORITHMS = ("max", "mse", "gptq", "awq", "awq+gptq")
# AWQ scales the weights, then rounds them as another algorithm does
AWQ_ROUNDING = {"awq": "max", "awq+gptq": "gptq"}
RULE_KEYS = ("pattern", "format", "algorithm", "group_size")
REQUIRED_RULE_KEYS = ("pattern", "format")


class Rule(NamedTuple):
    pattern: str  # a glob over module names
    format: str  # one of FORMATS: a weight format's name (eprt.quant.formats) or none
    algorithm: str  # one of ALGORITHMS


@dataclass(frozen=True)
class Recipe:
    name: str
    rules: tuple[Rule, ...]
    kv_cache: str | None
    mtp: bool = False  # the rules apply to the multi-token-prediction layers too
    # globs of modules left unquantized whatever the rules say; None: none named. The model-free
    # export (eprt.hf.streaming) takes them in place of its default list of modules it leaves alone.
    ignore: tuple[str, ...] | None = None

    def ignores(self, module: str) -> bool:
        return any(fnmatch.fnmatchcase(module, p) for p in self.ignore or ())

    def rule_of(self, module: str) -> Rule | None:
        """The first rule whose pattern matches `module`, or None (also where `ignore` names it)."""
        if self.ignores(module):
            return None
        return next((r for r in self.rules if fnmatch.fnmatchcase(module, r.pattern)), None)

    def format_of(self, module: str) -> str | None:
        rule = self.rule_of(module)
        return None if rule is None or rule.format == "none" else rule.format

    def algorithm_of(self, module: str) -> str | None:
        """How `module`'s weight scales are chosen (ALGORITHMS); None where it is not quantized."""
        return self.rule_of(module).algorithm if self.format_of(module) else None

    def rounding_of(self, module: str) -> str | None:
        """How `module`'s scaled weight is rounded: its algorithm, AWQ's the one it runs after."""
        algorithm = self.algorithm_of(module)
        return AWQ_ROUNDING.get(algorithm, algorithm)

    def balanced(self, module: str) -> bool:
        """Whether `module`'s rule asks for AWQ's scales."""
        return self.algorithm_of(module) in AWQ_ROUNDING

    @property
    def formats(self) -> list[str]:
        """The quantized formats the recipe uses: more than one makes a mixed-precision export."""
        return sorted({r.format for r in self.rules} - {"none"})

    @property
    def algorithms(self) -> list[str]:
        """The algorithms of the rules that quantize."""
        return sorted({r.algorithm for r in self.rules if r.format != "none"})

    @property
    def roundings(self) -> list[str]:
        """How the rules that quantize round their weights (`rounding_of`)."""
        return sorted({AWQ_ROUNDING.get(a, a) for a in self.algorithms})

    def to_json(self) -> dict:
        out = {"name": self.name, "quantize": [r._asdict() for r in self.rules], "kv_cache": self.kv_cache}
        # written only when set, so a recipe without them reads back (and pins) as before
        out = {**out, "mtp": True} if self.mtp else out
        return {**out, "ignore": list(self.ignore)} if self.ignore is not None else out


def available() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(RECIPE_DIR) if f.endswith(".yaml"))


def refuse_unknown_keys(d: dict, valid: tuple[str, ...], where: str) -> None:
    """A misspelt key would silently mean its default: name it and the keys that exist."""
    unknown = [k for k in d if k not in valid]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; the valid keys are {', '.join(valid)}")


def check_algorithm(algorithm, where: str) -> None:
    if algorithm not in ALGORITHMS:
        raise ConfigError(f"{where} {algorithm!r}: unknown algorithm; choose one of {', '.join(ALGORITHMS)}")


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
    return found.name


def parse_recipe(d: dict, source: str, kv_cache: str | None = None, algorithm: str | None = None) -> Recipe:
    """`algorithm`: what a rule that names none gets (default ALGORITHMS[0])."""
    default = ALGORITHMS[0] if algorithm is None else algorithm
    check_algorithm(default, "--algorithm")
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
        check_algorithm(r.get("algorithm", default), f"{source}: quantize[{i}] algorithm")
        fmt = grouped(r["format"], r["group_size"], f"{source}: quantize[{i}]") if "group_size" in r else r["format"]
        rules.append(Rule(str(r["pattern"]), fmt, r.get("algorithm", default)))
    if not {r.format for r in rules} - {"none"}:
        raise ConfigError(
            f"{source}: a recipe quantizes with at least one format, found none; "
            f"give a rule a format of {', '.join(FORMATS[:-1])}"
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
    ignore = d.get("ignore")
    if ignore is not None and (not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore)):
        raise ConfigError(
            f"{source}: ignore {ignore!r:.80}: write a list of module-name globs left unquantized "
            '(e.g. ["lm_head", "*.mlp.gate"]), or leave it out'
        )
    name = d.get("name", os.path.basename(source))
    if not isinstance(name, str):
        raise ConfigError(f"{source}: name {name!r:.80} is not a string; name the recipe in plain text")
    return Recipe(name, tuple(rules), kv, mtp, tuple(ignore) if ignore is not None else None)


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
    it (a str(), a comparison) would then build. A recipe has no use for them."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ConfigError(
                f"{self.name}:{event.start_mark.line + 1}: the YAML alias *{event.anchor} is not "
                "allowed in a recipe; write the value out"
            )
        return super().compose_node(parent, index)


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
