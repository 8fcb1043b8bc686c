"""Sizes as people write them on command lines."""

import re

from eprt.errors import ConfigError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(f"size {text!r}: write a number with an optional unit (B, KB, MB, GB, KiB, MiB, GiB)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])
