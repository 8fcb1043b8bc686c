"""Bounds on rendering an untrusted chat template: its time, the size of every value it builds.

Jinja's sandbox stops a template reaching Python, not a template spending the machine: 148 bytes
of nested loops render forever, and `{{ "x" * 3000000000 }}` allocates 3 GB before any output
can be measured. Here each operation that can build a large value from small ones (repetition
`*`, `**`, `%` formatting, concatenation `~` and `+`, and the `center`, `indent` and `format`
filters) is refused before it runs where its result would exceed MAX_VALUE_CHARS (or MAX_POWER_BITS
for a power), and the template's own code runs under a deadline of MAX_RENDER_SECONDS, checked
every few hundred lines it runs. Recursion ends at Python's limit, which the caller names.
"""

from __future__ import annotations

import math
import re
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from jinja2 import filters as jinja_filters
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_VALUE_CHARS = 1 << 24  # the longest string or list a template may build (and render)
MAX_POWER_BITS = 4096
MAX_RENDER_SECONDS = 10.0
CHECK_EVERY = 256  # template lines run between two looks at the clock
TEMPLATE_FILE = "<template>"  # the file name Jinja compiles a template from a string under
# a %-format's field width and precision: `%-10.3s`, `%*s`
FORMAT_FIELD = re.compile(r"%[-#0 +]*(\*|\d*)(?:\.(\*|\d*))?")


class Unbounded(Exception):
    """A template went past a bound: the message says which."""


def _size(value: Any) -> int | None:
    return len(value) if isinstance(value, (str, list, tuple)) else None


def check_binop(operator: str, left: Any, right: Any) -> None:
    """Refuse, before it runs, an operation whose result would exceed the bounds."""
    if operator == "*":
        for seq, n in ((left, right), (right, left)):
            if _size(seq) is not None and isinstance(n, int) and len(seq) * n > MAX_VALUE_CHARS:
                raise Unbounded(f"repeats a value {n} times ({len(seq) * n} items, more than {MAX_VALUE_CHARS})")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and abs(left) > 1 and right > 0:
            if right * math.log2(abs(left)) > MAX_POWER_BITS:
                raise Unbounded(f"raises {left} to the power {right} (more than {MAX_POWER_BITS} bits)")
    elif operator == "+":
        if _size(left) is not None and _size(right) is not None and len(left) + len(right) > MAX_VALUE_CHARS:
            raise Unbounded(f"joins values of more than {MAX_VALUE_CHARS} items")
    elif operator == "%" and isinstance(left, str):
        check_format(left, right)


def check_format(fmt: str, args: Any) -> None:
    """A %-format whose field widths or precisions (given, or taken from `args` by `*`) exceed the bound."""
    values = list(args) if isinstance(args, tuple) else [args]
    for field in FORMAT_FIELD.finditer(fmt):
        for width in field.groups():
            n = next((v for v in values if isinstance(v, int)), 0) if width == "*" else int(width or 0)
            if n > MAX_VALUE_CHARS:
                raise Unbounded(f"formats a field {n} characters wide (more than {MAX_VALUE_CHARS})")


def bounded_join(join):
    """Jinja's `~` (its `join` of the pieces), refused where the joined string would exceed the bound."""

    def bounded(seq) -> str:
        parts = [str(x) for x in seq]
        if sum(map(len, parts)) > MAX_VALUE_CHARS:
            raise Unbounded(f"joins strings of more than {MAX_VALUE_CHARS} characters")
        return join(parts)

    return bounded


def bounded_center(value: Any, width: int = 80) -> str:
    if isinstance(width, int) and width > MAX_VALUE_CHARS:
        raise Unbounded(f"centers text in {width} characters (more than {MAX_VALUE_CHARS})")
    return jinja_filters.do_center(value, width)


def bounded_indent(value: Any, width: Any = 4, *args, **kwargs) -> str:
    pad = width if isinstance(width, int) else len(str(width))
    if (pad + 1) * (str(value).count("\n") + 1) + len(str(value)) > MAX_VALUE_CHARS:
        raise Unbounded(f"indents text by {pad} characters a line (more than {MAX_VALUE_CHARS} in all)")
    return jinja_filters.do_indent(value, width, *args, **kwargs)


def bounded_format(value: Any, *args, **kwargs) -> str:
    check_format(str(value), tuple(args))
    return jinja_filters.do_format(value, *args, **kwargs)


class Sandbox(ImmutableSandboxedEnvironment):
    """Jinja2's immutable sandbox (as transformers renders templates), refusing by name a reach for
    a Python attribute, and every operation that would build a value past the bounds."""

    intercepted_binops = frozenset({"*", "**", "%", "+"})

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.filters.update(center=bounded_center, indent=bounded_indent, format=bounded_format)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__}")

    def call_binop(self, context, operator: str, left: Any, right: Any) -> Any:
        check_binop(operator, left, right)
        return super().call_binop(context, operator, left, right)

    def from_string(self, source, *args, **kwargs):
        template = super().from_string(source, *args, **kwargs)
        # `~` compiles to a call of the template module's own str_join / markup_join
        namespace = template.root_render_func.__globals__
        for join in ("str_join", "markup_join"):
            namespace[join] = bounded_join(namespace[join])
        return template


@contextmanager
def deadline(seconds: float | None = None) -> Iterator[None]:
    """Run a template's code under a deadline (MAX_RENDER_SECONDS by default): its own lines (not
    the library's) are traced, and every CHECK_EVERY of them the clock is read; past it, Unbounded
    is raised inside the template."""
    seconds = MAX_RENDER_SECONDS if seconds is None else seconds
    end = time.monotonic() + seconds
    lines = 0

    def local(frame, event, arg):
        nonlocal lines
        lines += 1
        if lines % CHECK_EVERY == 0 and time.monotonic() > end:
            raise Unbounded(f"ran longer than {seconds:g} s")
        return local

    def calls(frame, event, arg):
        return local if frame.f_code.co_filename == TEMPLATE_FILE else None

    previous = sys.gettrace()
    sys.settrace(calls)
    try:
        yield
    finally:
        sys.settrace(previous)
