"""The quality report's JSON, read as untrusted input: one typed, bounded schema.

Reports travel with exports from anywhere, so a page is drawn only from a report this schema
accepts: every value the page shows has its type (a number is a JSON number, never a string; a
count an integer), every list and string its bound, and the whole report is read from at most
MAX_REPORT_BYTES. A report breaking any of it is refused naming the key (`layers[3].top[0].module`)
and what it holds. Only the keys below come through: the page cannot print what the schema does
not know.

The bounds are those eprt puts on a model's config.json (eprt.config_fields): up to MAX_LAYERS
layers, MAX_EXPERTS experts per layer and MAX_ROUTED_EXPERTS experts in all, so a report of any
model eprt calibrates is read, and a 2 MB report claiming 300 x 1000 experts is refused before a
page is drawn from it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eprt.config_fields import MAX_EXPERTS, MAX_LAYERS, MAX_ROUTED_EXPERTS

MAX_REPORT_BYTES = 32 << 20  # a report of MAX_ROUTED_EXPERTS experts is a few MiB
MAX_NAME = 1024  # a module, group, recipe or file name
MAX_TEXT = 1 << 16  # a preview's text, a data description, a note
MAX_ROWS = 4096  # module groups, calibration sources, notes, a layer's listed modules


class Refused(ValueError):
    """A report value the schema does not accept: `at` (its key path) holds `what`."""

    def __init__(self, at: str, what: str):
        super().__init__(f"{at} {what}")
        self.at, self.what = at, what


def kind(value: Any) -> str:
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list"}.get(
        type(value), "an object" if isinstance(value, dict) else "null"
    )


@dataclass(frozen=True)
class Number:
    """A JSON number (an integer or a real: inf and nan are numbers too, shown as such)."""

    def read(self, value: Any, at: str) -> float | int:
        if type(value) not in (int, float):
            raise Refused(at, f"is {kind(value)}, not a number")
        return value


@dataclass(frozen=True)
class Count:
    """A non-negative integer no larger than `most`."""

    most: int = 2**53

    def read(self, value: Any, at: str) -> int:
        if type(value) is not int:
            raise Refused(at, f"is {kind(value)}, not an integer")
        if not 0 <= value <= self.most:
            raise Refused(at, f"is {value}, outside 0 to {self.most}")
        return value


@dataclass(frozen=True)
class Text:
    most: int = MAX_NAME

    def read(self, value: Any, at: str) -> str:
        if type(value) is not str:
            raise Refused(at, f"is {kind(value)}, not a string")
        if len(value) > self.most:
            raise Refused(at, f"is a string of {len(value)} characters, more than {self.most}")
        return value


@dataclass(frozen=True)
class Flag:
    def read(self, value: Any, at: str) -> bool:
        if type(value) is not bool:
            raise Refused(at, f"is {kind(value)}, not true or false")
        return value


@dataclass(frozen=True)
class Items:
    """A list of at most `most` values of `item`."""

    item: Any
    most: int = MAX_ROWS

    def read(self, value: Any, at: str) -> list:
        if type(value) is not list:
            raise Refused(at, f"is {kind(value)}, not a list")
        if len(value) > self.most:
            raise Refused(at, f"is a list of {len(value)}, more than {self.most}")
        return [self.item.read(v, f"{at}[{i}]") for i, v in enumerate(value)]


@dataclass(frozen=True)
class Named:
    """An object of at most `most` keys, each a name (Text), each value a `value`."""

    value: Any
    most: int = 64

    def read(self, value: Any, at: str) -> dict:
        if not isinstance(value, dict):
            raise Refused(at, f"is {kind(value)}, not an object")
        if len(value) > self.most:
            raise Refused(at, f"holds {len(value)} keys, more than {self.most}")
        return {Text().read(k, f"{at} (a key)"): self.value.read(v, f"{at}.{k}") for k, v in value.items()}


@dataclass(frozen=True)
class OrNull:
    spec: Any

    def read(self, value: Any, at: str) -> Any:
        return None if value is None else self.spec.read(value, at)


@dataclass(frozen=True)
class Fields:
    """An object with `required` keys and, where present, `optional` ones; other keys are dropped."""

    required: dict = field(default_factory=dict)
    optional: dict = field(default_factory=dict)

    def read(self, value: Any, at: str) -> dict:
        if not isinstance(value, dict):
            raise Refused(at, f"is {kind(value)}, not an object")
        out = {}
        for key, spec in {**self.required, **self.optional}.items():
            where = f"{at}.{key}" if at else key
            if key in value:
                out[key] = spec.read(value[key], where)
            elif key in self.required:
                raise Refused(where, "is missing")
        return out


MODULE = Fields({"module": Text(), "relative_error": Number(), "token_share": Number()})
LAYER = Fields(
    {"layer": Count(MAX_LAYERS), "relative_error": Number(), "top": Items(MODULE, 64)},
    {"expert_errors": Named(Items(OrNull(Number()), MAX_EXPERTS))},
)
EXPERT_IDS = Items(Count(MAX_EXPERTS), MAX_EXPERTS)
EXPERTS = Fields(
    {
        "module": Text(),
        "tokens": Items(Count(), MAX_EXPERTS),
        "unreached": EXPERT_IDS,
        "gptq_max_rounding": EXPERT_IDS,
        "unreached_handling": Text(MAX_TEXT),
    },
)
SOURCE = Fields(
    {
        "path": Text(MAX_TEXT),
        "share": Number(),
        "sequences": Count(),
        "held_out": Count(),
        "tokens": Count(),
        "documents": OrNull(Count()),  # null: token ids, which hold no documents
        "truncated": Count(),
        "repeated": Flag(),
    }
)
REPORT = Fields(
    required={
        "eval": Fields({"tokens": Count(), "data": Text(MAX_TEXT)}, {"sequences": Count(), "seq_len": Count()}),
        "kl_mean": Number(),
        "kl_p99": Number(),
        "top1_agreement": Number(),
        "perplexity": Fields({"unquantized": Number(), "quantized": Number()}),
        "layers": Items(LAYER, MAX_LAYERS),
    },
    optional={
        "router_flips": Number(),
        "notes": Items(Text(MAX_TEXT), 64),
        "model": Fields({"model_type": Text(), "manifest_sha256": Text(64)}, {"name": Text()}),
        "recipe": Fields({"name": Text()}, {"kv_cache": OrNull(Text()), "mtp": Flag()}),
        "groups": Items(Fields({"group": Text(), "format": Text(), "algorithm": Text(), "modules": Count()})),
        "auto_quantize": Fields(
            {"budget_bits": Number(), "effective_bits": Number(), "estimated_kl": Number(), "measured_kl": Number()}
        ),
        "calibration": Fields(
            {"algorithm": Text(), "samples": Count(), "seq_len": Count(), "tokens": Count()},
            {
                "data": Text(MAX_TEXT),
                "all_experts": Flag(),
                "gptq_min_tokens": Count(),
                "sources": Items(SOURCE),
            },
        ),
        "experts": Items(EXPERTS, MAX_LAYERS),
        "preview": OrNull(Fields({"prompt": Text(MAX_TEXT), "before": Text(MAX_TEXT), "after": Text(MAX_TEXT)})),
        "eval_ids_sha256": Text(64),
        "size": Fields(
            {
                "linear_parameters": Count(),
                "bytes_unquantized": Count(),
                "bytes_quantized": Count(),
                "bits_per_parameter": Number(),
                "bits_per_active_parameter": Number(),
            }
        ),
    },
)


def read_report_json(value: Any) -> dict:
    """The report `value` (parsed JSON) as the page may use it, or Refused naming the key."""
    report = REPORT.read(value, "")
    experts = report.get("experts", [])
    cells = sum(len(e["tokens"]) for e in experts)
    if cells > MAX_ROUTED_EXPERTS:
        raise Refused("experts", f"counts {cells} experts in all, more than {MAX_ROUTED_EXPERTS}")
    measured = sum(len(v) for x in report["layers"] for v in x.get("expert_errors", {}).values())
    if measured > MAX_ROUTED_EXPERTS:
        raise Refused("layers", f"measure {measured} experts in all, more than {MAX_ROUTED_EXPERTS}")
    for i, e in enumerate(experts):
        if len(e["tokens"]) != len(experts[0]["tokens"]):  # the token map is one rectangle
            raise Refused(
                f"experts[{i}].tokens", f"counts {len(e['tokens'])} experts, layer 0 {len(experts[0]['tokens'])}"
            )
        for key in ("unreached", "gptq_max_rounding"):
            if any(x >= len(e["tokens"]) for x in e[key]):
                raise Refused(f"experts[{i}].{key}", f"names an expert past its {len(e['tokens'])}")
    return report
