"""`eprt-check` from a clone: see eprt/commands/check.py (`python tools/check_export.py --help`)."""

import sys

from eprt.commands.check import main

if __name__ == "__main__":
    sys.exit(main())
