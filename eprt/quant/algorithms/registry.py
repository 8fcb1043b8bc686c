"""The calibration algorithms by name, and how a recipe rule names a sequence of them.

An algorithm is one registered object that owns its life in a run (eprt.quant.algorithms.base,
docs/adding-an-algorithm.md). This table holds what a recipe must know before anything is imported:
each algorithm's name, its role, whether it reads the calibration data, its typed parameters, and
where its object lives (`"module:Class"`, imported on first use, as a family's model class is).

A rule names a sequence: at most one balance (scales folded into what precedes a module), then at
most one rounding (how the scaled weight is rounded); a balance alone rounds as `max` does. Spelt

    algorithm: gptq                          # one algorithm, its default parameters
    algorithm: awq+gptq                      # a sequence, as eprt-ptq's --algorithm takes it
    algorithm: [awq, gptq]                   # the same sequence as a list
    algorithm: {gptq: {block: 128, damp: 0.01}}   # with parameters
    algorithm: [awq, {gptq: {damp: 0.02}}]

`rotate` in front of any sequence (`rotate+gptq`, `[rotate, gptq]`; `rotate` alone rounds as `max`)
reads the whole model rotated first (eprt.quant.rotation): a view of the checkpoint every rule shares,
not a step of a module's sequence (`unrotated` gives the sequence the module runs).

A rule holds its sequence as one canonical name (`awq+gptq`) and its parameters apart, written only
where they differ from the defaults, so a recipe that sets none records as it always did."""

from __future__ import annotations

import dataclasses
import importlib
from dataclasses import dataclass
from typing import NamedTuple

from eprt.errors import ConfigError

BALANCE, ROUNDING = "balance", "rounding"


@dataclass(frozen=True)
class GPTQParams:
    """GPTQ's column sweep (eprt.quant.algorithms.gptq.solve)."""

    block: int = 128  # columns per lazy-batch block
    damp: float = 0.01  # damping, a fraction of the Hessian's mean diagonal
    # aim at what the weight computes from the inputs as they are, from the inputs as the engine
    # quantizes them (GPTAQ's asymmetric calibration): for formats that quantize inputs (NVFP4 W4A4)
    quantized_inputs: bool = False
    # sweep the columns by descending Hessian diagonal, each under its own block's scale (llm-compressor's
    # "static" activation order; false: in their order): the export's layout is the same either way;
    # None: as the format says (WeightFormat.gptq_actorder: every format but FP8 block)
    actorder: bool | None = None

    def orders_columns(self, fmt) -> bool:
        """Whether GPTQ sweeps weight format `fmt`'s columns in descending-diagonal order."""
        return fmt.gptq_actorder if self.actorder is None else self.actorder


@dataclass(frozen=True)
class GPTQRunOptions:
    """GPTQ's options for a whole run, each set by eprt-ptq's --gptq-FIELD."""

    min_tokens: int = 128  # a routed expert with fewer calibration tokens keeps max rounding and is listed

    def probed(self) -> GPTQRunOptions:
        """As the time probe runs it: every expert a probe step reaches is solved, as a run's many
        tokens reach them all."""
        return dataclasses.replace(self, min_tokens=1)


class Entry(NamedTuple):
    name: str
    role: str  # BALANCE or ROUNDING
    weight_only: bool  # sets the scales from the weights alone: a data-free run may take it
    params: type | None  # its typed parameters (a frozen dataclass of defaults), None where it has none
    home: str  # "module:Class" of its object
    follows: tuple[str, ...] = ()  # a rounding: the balances it may round after
    # its options for a whole run (a frozen dataclass of positive ints with their defaults and a
    # `probed()`), each field set by eprt-ptq's --NAME-FIELD (PTQArgs.NAME_FIELD)
    options: type | None = None
    # the quality report's per-expert lists it fills (eprt.quant.run.expert_coverage): report key -> its
    # summary entry of {experts module: global expert ids}
    expert_notes: tuple[tuple[str, str], ...] = ()
    # "module:Class" of its part of the calibration record (eprt.quant.calibrated.RecordPart); "" for none
    record: str = ""


ALGORITHMS: dict[str, Entry] = {
    e.name: e
    for e in (
        Entry("max", ROUNDING, True, None, "eprt.quant.algorithms.statistics:Max"),
        Entry("mse", ROUNDING, True, None, "eprt.quant.algorithms.statistics:MSE"),
        Entry(
            "gptq",
            ROUNDING,
            False,
            GPTQParams,
            "eprt.quant.algorithms.gptq.algorithm:GPTQAlgorithm",
            follows=("awq",),
            options=GPTQRunOptions,
            expert_notes=(("gptq_max_rounding", "gptq_skipped_experts"),),
            record="eprt.quant.algorithms.gptq.record:GPTQRecord",
        ),
        Entry(
            "awq",
            BALANCE,
            False,
            None,
            "eprt.quant.algorithms.awq.algorithm:AWQAlgorithm",
            record="eprt.quant.algorithms.awq.folds:Folds",
        ),
    )
}
DEFAULT = "max"  # a balance alone rounds as this does; a rule that names nothing takes it
ROTATE = "rotate"  # the whole model read rotated before any algorithm runs (eprt.quant.rotation)


def sequences() -> tuple[str, ...]:
    """Every sequence a rule may name: every algorithm (a balance alone rounds as DEFAULT does),
    then each balance followed by each rounding that may follow it; then each rotated (`rotate`
    alone: DEFAULT's rounding of the rotated weights)."""
    plain = (*ALGORITHMS, *(f"{b}+{e.name}" for e in ALGORITHMS.values() for b in e.follows))
    return (*plain, ROTATE, *(f"{ROTATE}+{p}" for p in plain if p != DEFAULT))


def rotated(sequence: str) -> bool:
    return sequence == ROTATE or sequence.startswith(f"{ROTATE}+")


def unrotated(sequence: str) -> str:
    """The sequence a module runs on the weights as the run reads them (rotated or not)."""
    return DEFAULT if sequence == ROTATE else sequence.removeprefix(f"{ROTATE}+")


def steps(sequence: str) -> tuple[str, ...]:
    """The algorithms a sequence runs, in order, its rounding made explicit: `awq` -> (awq, max)."""
    names = tuple(unrotated(sequence).split("+"))
    return names if ALGORITHMS[names[-1]].role == ROUNDING else (*names, DEFAULT)


def rounding(sequence: str) -> str:
    return steps(sequence)[-1]


def object_of(name: str):
    """The registered object of algorithm `name`, imported on first use."""
    return imported(ALGORITHMS[name].home)()


def imported(home: str):
    module, _, attr = home.partition(":")
    return getattr(importlib.import_module(module), attr)


def record_parts() -> dict[str, type]:
    """The classes of the algorithms' parts of the calibration record, by algorithm, in the order
    their tensors are written (the registry's)."""
    return {e.name: imported(e.record) for e in ALGORITHMS.values() if e.record}


Params = tuple[tuple[str, tuple[tuple[str, object], ...]], ...]  # ((algorithm, ((field, value), ...)), ...)


def parse_algorithm(value, where: str) -> tuple[str, Params]:
    """A rule's `algorithm` value in any of its spellings -> (its canonical sequence name, the
    parameters it sets that differ from their defaults), refused by `where` when it is none."""
    items = value if isinstance(value, list) else [value]
    if isinstance(value, str):
        items = value.split("+")
    names, params = [], []
    for item in items:
        if isinstance(item, dict) and len(item) == 1:
            ((name, given),) = item.items()
            names.append(name)
            set_ = typed_params(name, given, where)
            if set_:
                params.append((name, set_))
        elif isinstance(item, str):
            names.append(item)
        else:
            raise ConfigError(f"{where} {value!r}: name an algorithm, a list of them or {{NAME: {{PARAM: VALUE}}}}")
    sequence = "+".join(names)
    if sequence not in sequences():
        raise ConfigError(f"{where} {value!r}: unknown algorithm; choose one of {', '.join(sequences())}")
    return sequence, tuple(params)


def typed_params(name: str, given, where: str) -> tuple[tuple[str, object], ...]:
    """`given` ({field: value}) checked against algorithm `name`'s parameters: the fields set that
    differ from their defaults, each of its declared type (an int is taken where a float is; a
    number must be positive)."""
    entry = ALGORITHMS.get(name)
    if entry is None:
        raise ConfigError(f"{where}: unknown algorithm {name!r}; choose one of {', '.join(ALGORITHMS)}")
    fields = {f.name: f for f in dataclasses.fields(entry.params)} if entry.params else {}
    if not isinstance(given, dict):
        raise ConfigError(f"{where} {name}: give its parameters as a mapping {{PARAM: VALUE}}")
    out = []
    for key, v in given.items():
        if key not in fields:
            known = ", ".join(fields) or "none"
            raise ConfigError(f"{where} {name}: unknown parameter {key!r}; its parameters are {known}")
        default = fields[key].default
        # a switch without a default of its own is left to another setting (GPTQ's actorder: the format's)
        kind = bool if default is None else type(default)
        if kind is bool:
            if not isinstance(v, bool):
                said = "the format's" if default is None else str(default).lower()
                raise ConfigError(f"{where} {name} {key} {v!r}: give true or false (default {said})")
        elif isinstance(v, bool) or not (isinstance(v, kind) or (kind is float and isinstance(v, int))) or not v > 0:
            raise ConfigError(f"{where} {name} {key} {v!r}: give a positive {kind.__name__} (default {default})")
        if v != default:
            out.append((key, kind(v)))
    return tuple(out)


def params_of(name: str, params: Params):
    """Algorithm `name`'s typed parameters, as a rule sets them (`params`) over the defaults."""
    entry = ALGORITHMS[name]
    return entry.params(**dict(dict(params).get(name, ()))) if entry.params else None


def option_flags() -> dict[str, str]:
    """Every algorithm's run options by their PTQArgs field (`gptq_min_tokens`) -> their flag."""
    return {
        f"{e.name}_{f.name}": f"--{e.name}-{f.name.replace('_', '-')}"
        for e in ALGORITHMS.values()
        if e.options
        for f in dataclasses.fields(e.options)
    }


def option_default(field: str):
    """The default of run option `field` (a key of option_flags)."""
    entry = next(e for e in ALGORITHMS.values() if e.options and field.startswith(f"{e.name}_"))
    return getattr(entry.options(), field.removeprefix(f"{entry.name}_"))


def run_options(values: dict, probed: bool = False) -> dict[str, object]:
    """Each algorithm's run options from `values` ({PTQArgs field: value}, as option_flags names
    them), refused by flag where one is not positive; `probed`: as the time probe runs them."""
    out = {}
    for e in ALGORITHMS.values():
        if e.options is None:
            continue
        given = {}
        for f in dataclasses.fields(e.options):
            key = f"{e.name}_{f.name}"
            if values[key] < 1:
                raise ConfigError(f"{option_flags()[key]} {values[key]} must be positive")
            given[f.name] = values[key]
        out[e.name] = e.options(**given).probed() if probed else e.options(**given)
    return out


def expert_notes() -> dict[str, str]:
    """The quality report's per-expert lists the algorithms fill: report key -> the summary entry it
    comes from (eprt.quant.run.expert_coverage.starved_experts)."""
    return {key: entry for e in ALGORITHMS.values() for key, entry in e.expert_notes}
