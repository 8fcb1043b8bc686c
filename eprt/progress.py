"""Progress and logging: one bar (on rank 0), and log lines that say which rank speaks, written
through the bar (tqdm.write) so that a line never breaks into it. A quiet run (`--quiet`, or
EPRT_QUIET=1 in the environment, which a launcher's ranks inherit) shows no bar and warnings only."""

from __future__ import annotations

import logging
import os
import sys

from tqdm import tqdm

QUIET = "EPRT_QUIET"  # set: no progress bar, and of eprt's log only warnings and errors


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def quiet() -> bool:
    return os.environ.get(QUIET) == "1"


def bar(total: float, desc: str, *, unit: str = "it", enabled: bool = True, **kw) -> tqdm:
    """A progress bar on stderr, shown on rank 0 only, so a multi-rank job prints one.

    Its remaining time is what is left at the average rate since the start (tqdm's smoothing 0), not at a
    moving average of the last updates: a calibration's steps come in bursts between the work each layer
    does besides them (reading it, GPTQ's solve), which the last steps' rate would leave out; once a layer
    is done, the average holds one of each."""
    return tqdm(
        total=total,
        desc=desc,
        unit=unit,
        disable=not enabled or rank() != 0 or quiet(),
        file=sys.stderr,
        dynamic_ncols=True,
        unit_scale=unit == "B",
        unit_divisor=1024 if unit == "B" else 1000,
        **{"smoothing": 0, **kw},
    )


def logger() -> logging.Logger:
    """eprt's logger, as the process has configured it: a library that configured it on first use
    would let whichever caller came first decide (configure_logging is the commands')."""
    return logging.getLogger("eprt")


class RankHandler(logging.StreamHandler):
    """eprt's lines on stderr, each saying which rank speaks, written above the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # as logging's own handlers do: a failed line is reported, not raised
            self.handleError(record)


def configure_logging(quiet_run: bool = False) -> None:
    """Once, by the command that runs: INFO and up on stderr as `[eprt rank R] message` (WARNING and
    up, and no bar, for a quiet run: `quiet_run`, or EPRT_QUIET=1). Again in one process (commands
    run in-process), the handler is replaced, not added: one line per record."""
    if quiet_run:
        os.environ[QUIET] = "1"  # the bars, and the ranks a launcher starts, read it
    log = logging.getLogger("eprt")
    for h in [h for h in log.handlers if isinstance(h, RankHandler)]:
        log.removeHandler(h)
    h = RankHandler(sys.stderr)
    h.setFormatter(logging.Formatter(f"[eprt rank {rank()}] %(message)s"))
    log.addHandler(h)
    log.setLevel(logging.WARNING if quiet() else logging.INFO)
