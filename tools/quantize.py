"""`eprt-quantize` from a clone: see eprt/commands/quantize.py (`python tools/quantize.py --help`)."""

import sys

from eprt.commands.quantize import main

if __name__ == "__main__":
    sys.exit(main())
