"""Command-line settings as data: a dataclass whose fields carry their flag's help (and its type,
choices, metavar) builds its argparse parser and is built back from what the parser read, so a
setting is written once, in the field, and a flag is added by adding a field.

    @dataclass(frozen=True)
    class Args:
        ckpt: str = flag(help="the checkpoint", positional=True)
        seq_len: int = flag(256, help="tokens per sequence")       # --seq-len, int, default 256
        resume: bool = flag(False, help="continue a killed run")   # --resume, store_true
        data: tuple[str, ...] = flag((), help="a data file")        # --data, repeated: each one appended
        progress: bool = True                                      # not a flag: set by callers only

A field's flag is `--` and its name with `-` for `_`; its argparse type is the field's own
(int, float, str, bool as a switch, a tuple for a flag given again and again) unless `type`
says otherwise.
"""

from __future__ import annotations

import argparse
import dataclasses
import typing
from typing import Any, Callable

_FLAG = "flag"
_NO_DEFAULT = dataclasses.MISSING


def flag(
    default: Any = None,
    *,
    help: str,
    type: Callable[[str], Any] | None = None,
    choices: typing.Sequence[str] | None = None,
    metavar: str | None = None,
    const: Any = _NO_DEFAULT,
    positional: bool = False,
) -> Any:
    """A dataclass field that is also a command-line flag. `const`: the value of the flag given
    without one (argparse's nargs='?'); `positional`: an argument without a flag, always given."""
    spec = {
        "help": help,
        "type": type,
        "choices": choices,
        "metavar": metavar,
        "const": const,
        "positional": positional,
    }
    if positional:
        return dataclasses.field(metadata={_FLAG: spec})
    return dataclasses.field(default=default, metadata={_FLAG: spec})


def flag_fields(cls: type) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if _FLAG in f.metadata]


def add_flags(parser: argparse.ArgumentParser, cls: type) -> None:
    """Add every flag field of dataclass `cls` to `parser`, in field order."""
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        spec = f.metadata[_FLAG]
        kwargs: dict[str, Any] = {"help": spec["help"]}
        if spec["metavar"] is not None:
            kwargs["metavar"] = spec["metavar"]
        if spec["choices"] is not None:
            kwargs["choices"] = list(spec["choices"])
        if spec["positional"]:
            parser.add_argument(f.name, **kwargs)
            continue
        if hints[f.name] is bool:
            parser.add_argument(flag_name(f.name), action="store_true", **kwargs)
            continue
        repeated = typing.get_origin(hints[f.name]) is tuple
        if repeated:  # appended to a list of its own, not to the default (argparse would extend it)
            kwargs["action"] = "append"
        kwargs["type"] = spec["type"] or _scalar(typing.get_args(hints[f.name])[0] if repeated else hints[f.name])
        if spec["const"] is not _NO_DEFAULT:
            kwargs.update(nargs="?", const=spec["const"])
        parser.add_argument(flag_name(f.name), default=None if repeated else f.default, **kwargs)


def from_flags(cls: type, namespace: argparse.Namespace, **others: Any) -> Any:
    """The `cls` that the flags in `namespace` spell (`others`: its fields that are no flag)."""
    values = {}
    for f in flag_fields(cls):
        value = getattr(namespace, f.name)
        if isinstance(value, list):  # a repeated flag's values
            value = tuple(value)
        elif value is None and isinstance(f.default, tuple):  # a repeated flag not given
            value = f.default
        values[f.name] = value
    return cls(**values, **others)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def _scalar(hint: Any) -> Callable[[str], Any]:
    """The type argparse converts a value to: the field's, less its `| None`."""
    options = [t for t in typing.get_args(hint) if t is not type(None)] or [hint]
    if len(options) != 1 or options[0] not in (int, float, str):
        raise TypeError(f"a flag of type {hint} needs its own type= converter")
    return options[0]
