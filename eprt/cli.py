"""What every command-line tool shares: logging set up once, and refusals as one clear line, exit 2.

In a multi-rank run every rank prints its own line, saying which rank speaks. A process alone
prints the refusal itself, not the fail-together report around it ("rank 0 failed while ...").
A rank started by a launcher also files its line where the launcher reads it
(TORCHELASTIC_ERROR_FILE), so the launcher can end with the cause (eprt.commands.launch); a rank
eprt's own launcher started (`--nproc-per-node`: LAUNCHED in its environment) leaves the printing
to it, so a refusal reads as one line, not one a rank and the launcher's.

A file system that refuses a write (read-only, full, over quota, not permitted) is the user's
to fix, not a bug: it prints as one line naming the path. Any other OSError keeps its traceback.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import signal
import sys
import time
from typing import Callable, TypeVar

import eprt
from eprt.errors import EprtError
from eprt.progress import configure_logging
from eprt.storage.atomic import write_file

T = TypeVar("T")
LAUNCHED = "EPRT_LAUNCHED"  # set in the ranks eprt's launcher starts: it prints their verdict

# errno -> the way out, for the OSErrors a user's file system raises
USER_OS_ERRORS = {
    errno.EROFS: "the file system is read-only: write the output elsewhere",
    errno.ENOSPC: "the disk is full: free space or write the output elsewhere",
    errno.EDQUOT: "the disk quota is exceeded: free space or write the output elsewhere",
    errno.EACCES: "permission denied: write the output where you may write, or fix its permissions",
    errno.EPERM: "operation not permitted: write the output where you may write, or fix its permissions",
}


# what a command's help names in the repository, as an installed eprt's user finds it
PUBLISHED = (
    (re.compile(r"docs/([\w-]+)\.md"), r"`eprt-docs \1`"),
    (re.compile(r"eprt/configs/ptq"), "the shipped recipes (eprt-quantize --list-recipes)"),
    (re.compile(r"\s*\(or python tools/[\w.]+\)"), ""),
)


def published(text: str) -> str:
    for pattern, repl in PUBLISHED:
        text = pattern.sub(repl, text)
    return text


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """The description as written, and each option's default after its help where it has one the
    help does not already give; docs and recipes named where an installed eprt's user finds them."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = published(action.help or "")
        if "default" in text or action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return text
        return f"{text} (default: {action.default})"

    def _format_text(self, text: str) -> str:
        return super()._format_text(published(text))


def command_parser(doc: str, page: str, prog: str | None = None) -> argparse.ArgumentParser:
    """A command's parser: its docstring as the description, defaults shown, `--version`, and the
    published docs `page` it is described on."""
    ap = argparse.ArgumentParser(
        prog=prog,
        description=doc,
        formatter_class=HelpFormatter,
        epilog=f"Documentation: eprt-docs {page} (the pages ship with eprt; eprt-docs lists them)",
    )
    ap.add_argument("--version", action="version", version=f"eprt {eprt.__version__}")
    return ap


def run(main: Callable[[], T], quiet: bool = False) -> T:
    """`main()`'s result (a console script's exit status), or exit 2 with the refusal's line.
    `quiet`: warnings only, and no progress bar (eprt.progress)."""
    configure_logging(quiet)
    try:
        return main()
    except EprtError as e:
        alone = int(os.environ.get("WORLD_SIZE", "1")) <= 1
        cause = e.__cause__
        if alone and (isinstance(cause, EprtError) or user_os_error(cause)):
            e = cause
        refuse(user_os_error(e) or str(e))
    except OSError as e:
        if not user_os_error(e):
            file_verdict(f"{type(e).__name__}: {e} (a bug in eprt; its traceback is above)")
            raise
        refuse(user_os_error(e))
    except Exception as e:  # a bug: its traceback stays, and a launcher learns its one line
        file_verdict(f"{type(e).__name__}: {e} (a bug in eprt; its traceback is above)")
        raise
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (eprt.parallel.liveness.Interrupted): one line, no traceback
        name = getattr(e, "signal", "SIGINT")
        message = f"stopped by {name}; nothing was published (a calibration continues with --resume)"
        print(f"interrupted{_speaker()}: {message}", file=sys.stderr)
        file_verdict(f"stopped by {name}")
        sys.exit(128 + getattr(signal, name, signal.SIGINT))


def user_os_error(e: BaseException | None) -> str | None:
    """One line for an OSError the user's file system raised, naming the path; None for others."""
    if not isinstance(e, OSError) or e.errno not in USER_OS_ERRORS:
        return None
    where = f"{e.filename}: " if e.filename else "writing the output: "
    return f"{where}{USER_OS_ERRORS[e.errno]} ({e.strerror or os.strerror(e.errno)})"


def refuse(message: str) -> None:
    if os.environ.get(LAUNCHED) != "1":
        print(f"error{_speaker()}: {message}", file=sys.stderr)
    file_verdict(message)
    sys.exit(2)


def file_verdict(message: str) -> None:
    """Leave this rank's one-line verdict where the launcher that started it reads it: torch's error
    file (its `message` and `timestamp`), with the time to the microsecond to tell the first failure."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    try:
        write_file(path, json.dumps({"message": message, "timestamp": int(now), "eprt_time": now}))
    except (OSError, EprtError):  # the verdict is also on stderr; a launcher without it says how the rank ended
        pass


def _speaker() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f" (rank {os.environ.get('RANK', '0')} of {world})" if world > 1 else ""
