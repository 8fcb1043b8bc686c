"""What every command-line tool shares: refusals print as one clear line and exit 2."""

from __future__ import annotations

import sys
from typing import Callable

from eprt.errors import EprtError


def run(main: Callable[[], object]) -> None:
    try:
        main()
    except EprtError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
