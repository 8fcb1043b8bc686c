"""What every command-line tool shares: refusals print as one clear line and exit 2.

In a multi-rank run every rank prints its own line, saying which rank speaks. A process alone
prints the refusal itself, not the fail-together report around it ("rank 0 failed while ...").
"""

from __future__ import annotations

import os
import sys
from typing import Callable, TypeVar

from eprt.errors import EprtError

T = TypeVar("T")


def run(main: Callable[[], T]) -> T:
    """`main()`'s result (a console script's exit status), or exit 2 with the refusal's line."""
    try:
        return main()
    except EprtError as e:
        alone = int(os.environ.get("WORLD_SIZE", "1")) <= 1
        if alone and isinstance(e.__cause__, EprtError):
            e = e.__cause__
        print(f"error{_speaker()}: {e}", file=sys.stderr)
        sys.exit(2)


def _speaker() -> str:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return f" (rank {os.environ.get('RANK', '0')} of {world})" if world > 1 else ""
