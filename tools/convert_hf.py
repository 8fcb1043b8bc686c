"""`eprt-convert` from a clone: see eprt/commands/convert.py (`python tools/convert_hf.py --help`)."""

import sys

from eprt.commands.convert import main

if __name__ == "__main__":
    sys.exit(main())
