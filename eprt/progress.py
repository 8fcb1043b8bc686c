"""Progress and logging: one bar (on rank 0), and log lines that say which rank speaks."""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def bar(total: float, desc: str, *, unit: str = "it", enabled: bool = True, **kw) -> tqdm:
    """A progress bar on stderr, shown on rank 0 only, so a multi-rank job prints one."""
    return tqdm(total=total, desc=desc, unit=unit, disable=not enabled or rank() != 0,
                file=sys.stderr, dynamic_ncols=True, unit_scale=unit == "B", unit_divisor=1024 if unit == "B" else 1000, **kw)


def logger(name: str = "eprt") -> logging.Logger:
    log = logging.getLogger(name)
    if not log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter(f"[eprt rank {rank()}] %(message)s"))
        log.addHandler(h)
        log.setLevel(logging.INFO)
        log.propagate = False
    return log
