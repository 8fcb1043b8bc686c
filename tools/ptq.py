"""`eprt-ptq` from a clone: see eprt/commands/ptq.py (`python tools/ptq.py --help`)."""

import sys

from eprt.commands.ptq import main

if __name__ == "__main__":
    sys.exit(main())
