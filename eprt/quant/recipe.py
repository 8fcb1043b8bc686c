"""PTQ recipes: which modules get which format, by glob patterns over module names.

A recipe is a YAML file (eprt/configs/ptq/NAME.yaml, or any path):

    name: nvfp4_experts_only
    quantize:                      # the first pattern that matches a module decides
      - {pattern: "*.experts", format: nvfp4}
      - {pattern: "*", format: none}
    kv_cache: null                 # or fp8
    mtp: false                     # true: the rules quantize the multi-token-prediction layers too

Different patterns may give different formats (mixed precision: NVFP4 experts, FP8 attention).
Module names are the Hugging Face module names (`model.layers.3.self_attn.q_proj`); a MoE
layer's routed experts are one module (`model.layers.3.mlp.experts`). Whatever a recipe says,
a family's never-quantized modules (embeddings, lm_head, routers, ...) stay unquantized.

The multi-token-prediction layers (DeepSeek-V3's `model.layers.{num_hidden_layers + k}`) are
carried through unquantized unless the recipe says `mtp: true`: then the same rules, first match
wins, decide their modules' formats too (eprt.quant.feasibility).
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

import yaml

from eprt.errors import ConfigError

# Shipped inside the package (package data), so an installed eprt finds them wherever it runs.
RECIPE_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "ptq")
FORMATS = ("fp8", "nvfp4", "none")
KV_FORMATS = (None, "fp8")
RECIPE_KEYS = ("name", "quantize", "kv_cache", "mtp")
RULE_KEYS = ("pattern", "format")


@dataclass(frozen=True)
class Recipe:
    name: str
    rules: tuple[tuple[str, str], ...]  # (glob, format)
    kv_cache: str | None
    mtp: bool = False  # the rules apply to the multi-token-prediction layers too

    def format_of(self, module: str) -> str | None:
        for pattern, fmt in self.rules:
            if fnmatch.fnmatchcase(module, pattern):
                return None if fmt == "none" else fmt
        return None

    @property
    def formats(self) -> list[str]:
        """The quantized formats the recipe uses: more than one makes a mixed-precision export."""
        return sorted({f for _, f in self.rules} - {"none"})

    def to_json(self) -> dict:
        out = {"name": self.name, "quantize": [{"pattern": p, "format": f} for p, f in self.rules],
               "kv_cache": self.kv_cache}
        # written only when set, so a recipe without it reads back (and pins) as before
        return {**out, "mtp": True} if self.mtp else out


def available() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(RECIPE_DIR) if f.endswith(".yaml"))


def refuse_unknown_keys(d: dict, valid: tuple[str, ...], where: str) -> None:
    """A misspelt key would silently mean its default: name it and the keys that exist."""
    unknown = [k for k in d if k not in valid]
    if unknown:
        raise ConfigError(f"{where}: unknown key {unknown[0]!r}; the valid keys are {', '.join(valid)}")


def parse_recipe(d: dict, source: str, kv_cache: str | None = None) -> Recipe:
    if isinstance(d, dict):
        refuse_unknown_keys(d, RECIPE_KEYS, source)
    if not isinstance(d, dict) or not isinstance(d.get("quantize"), list) or not d["quantize"]:
        raise ConfigError(f"{source}: a recipe needs a non-empty `quantize` list of {{pattern, format}}")
    rules = []
    for i, r in enumerate(d["quantize"]):
        if isinstance(r, dict):
            refuse_unknown_keys(r, RULE_KEYS, f"{source}: quantize[{i}]")
        if not isinstance(r, dict) or set(r) != set(RULE_KEYS):
            raise ConfigError(f"{source}: quantize[{i}] must be {{pattern: GLOB, format: {'|'.join(FORMATS)}}}")
        if r["format"] not in FORMATS:
            raise ConfigError(f"{source}: quantize[{i}] format {r['format']!r}; choose one of {', '.join(FORMATS)}")
        rules.append((str(r["pattern"]), r["format"]))
    if not {f for _, f in rules} - {"none"}:
        raise ConfigError(f"{source}: a recipe quantizes with at least one format, found none; "
                          f"give a rule a format of {', '.join(FORMATS[:-1])}")
    kv = kv_cache if kv_cache is not None else d.get("kv_cache")
    if kv not in KV_FORMATS:
        raise ConfigError(f"{source}: kv_cache {kv!r}; choose fp8 or null")
    mtp = d.get("mtp", False)
    if not isinstance(mtp, bool):
        raise ConfigError(f"{source}: mtp {mtp!r}; write true (quantize the multi-token-prediction layers by the same "
                          "rules) or false (carry them through unquantized, the default)")
    return Recipe(str(d.get("name", os.path.basename(source))), tuple(rules), kv, mtp)


def load_recipe(spec: str, kv_cache: str | None = None) -> Recipe:
    """A recipe by name (eprt/configs/ptq/NAME.yaml) or by path."""
    path = spec if os.path.isfile(spec) else os.path.join(RECIPE_DIR, f"{spec}.yaml")
    if not os.path.isfile(path):
        raise ConfigError(f"--recipe {spec!r}: no such recipe; choose one of {', '.join(available())} or give a YAML path")
    with open(path) as f:
        try:
            d = yaml.safe_load(f)
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({e})") from None
    return parse_recipe(d, path, kv_cache)
