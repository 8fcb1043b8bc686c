"""What every command-line tool shares: logging set up once, and refusals as one clear line, exit 2.

In a multi-rank run every rank prints its own line, saying which rank speaks. A process alone
prints the refusal itself, not the fail-together report around it ("rank 0 failed while ...").
A rank started by a launcher also files its line where the launcher reads it
(TORCHELASTIC_ERROR_FILE), so the launcher can end with the cause (eprt.commands.launch).

A file system that refuses a write (read-only, full, over quota, not permitted) is the user's
to fix, not a bug: it prints as one line naming the path. Any other OSError keeps its traceback.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from typing import Callable, TypeVar

from eprt.errors import EprtError
from eprt.progress import configure_logging
from eprt.storage.atomic import write_file

T = TypeVar("T")

# errno -> the way out, for the OSErrors a user's file system raises
USER_OS_ERRORS = {
    errno.EROFS: "the file system is read-only: write the output elsewhere",
    errno.ENOSPC: "the disk is full: free space or write the output elsewhere",
    errno.EDQUOT: "the disk quota is exceeded: free space or write the output elsewhere",
    errno.EACCES: "permission denied: write the output where you may write, or fix its permissions",
    errno.EPERM: "operation not permitted: write the output where you may write, or fix its permissions",
}


def run(main: Callable[[], T]) -> T:
    """`main()`'s result (a console script's exit status), or exit 2 with the refusal's line."""
    configure_logging()
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
