"""The format search's budget and default candidates, as the command line gives them: no torch,
so a command's parser (and its `--help`) reads them without loading the model code."""

from __future__ import annotations

import math
import re

from eprt.errors import ConfigError

DEFAULT_CANDIDATES = ("nvfp4", "fp8", "none")
UNQUANTIZED_BITS = 16  # bf16


def parse_budget(text: str) -> float:
    """`4.8bits` or `4.8`: effective bits per active parameter."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*(?:bits?)?\s*", str(text))
    if not m or float(m.group(1)) <= 0:
        raise ConfigError(f"--auto-quantize {text!r}: give the budget as effective bits per parameter, e.g. 4.8bits")
    return check_budget(float(m.group(1)))


def check_budget(bits: float) -> float:
    """A budget the search can spend: positive and at most UNQUANTIZED_BITS (more buys nothing; an
    infinite one would run the whole search and then overflow)."""
    if not (math.isfinite(bits) and 0 < bits <= UNQUANTIZED_BITS):
        raise ConfigError(
            f"--auto-quantize {bits:g}bits: give a budget of bits per parameter above 0 and at most "
            f"{UNQUANTIZED_BITS} (bf16's), e.g. 4.8bits"
        )
    return bits
