"""Sizes as people write them on command lines, and as eprt prints them.

KB, MB, GB and TB are powers of 1000, KiB, MiB, GiB and TiB powers of 1024 (as Hugging Face's
`max_shard_size` and the SI/IEC prefixes read them); a bare number is bytes.
"""

import re

from eprt.errors import ConfigError

_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}


def parse_size(text: str, setting: str = "size") -> int:
    """The bytes of '64GiB', '500MB', '1.5TB' or '4096'; `setting` names the flag in a refusal."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ConfigError(
            f"{setting} {text!r}: write a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, "
            "GiB, TiB), e.g. 64GiB"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def format_bytes(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
