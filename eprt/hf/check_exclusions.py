"""An export's exclude entries (ModelOpt's exclude_modules), matched as each engine matches them.

vLLM skips a module when an exclude entry equals its name, is a substring of it, or matches it as
an fnmatch pattern (after splitting a pattern `X*` into `X` and `X.*`); SGLang matches exact
names and `*` patterns (eprt.hf.check_export has the rules the checks draw from this).
"""

from __future__ import annotations

import functools
import re
from collections import defaultdict
from fnmatch import fnmatchcase


class Exclusions:
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
        self.split_patterns = [
            (e, p)
            for e in self.patterns
            for p in ((e[:-1], e[:-1] + ".*") if len(e) >= 2 and e[-1] == "*" and e[-2] != "." else (e,))
        ]

    def first(self, found: set[str]) -> str:
        return min(found, key=self.order.__getitem__)

    def inside(self, name: str) -> set[str]:
        """The entries that are substrings of `name` (vLLM's reading)."""
        found = {name[i : i + n] for n in self.literal_lengths for i in range(len(name) - n + 1)} & self.literal
        if _MAGIC.search(name):  # a wildcard entry is a substring only of a name holding its wildcard
            found |= {e for e in self.order if e not in self.literal and e in name}
        return found

    def matching(self, name: str) -> set[str]:
        """The entries `name` matches as fnmatch patterns (SGLang's reading; a literal: equal)."""
        return ({name} & self.literal) | self.prefixed.of(name) | {e for e in self.patterns if fnmatchcase(name, e)}

    def split_matching(self, name: str) -> set[str]:
        """The entries `name` matches after vLLM splits each `X*` into `X` and `X.*`."""
        exact = {self.split_exact[name]} if name in self.split_exact else set()
        return (
            ({name} & self.literal)
            | exact
            | self.split_prefixed.of(name)
            | {e for e, p in self.split_patterns if fnmatchcase(name, p)}
        )

    @functools.cached_property
    def expert_holders(self) -> dict[str, str]:
        """Each name ending in `experts` that some entry holds -> the first such entry."""
        holders = {}
        for e in self.order:
            for m in re.finditer("experts", e):
                for i in range(m.start() + 1):
                    holders.setdefault(e[i : m.end()], e)
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
