"""`eprt-report` from a clone: see eprt/commands/report.py (`python tools/report.py --help`)."""

import sys

from eprt.commands.report import main

if __name__ == "__main__":
    sys.exit(main())
