"""`eprt-make-tiny` from a clone: see eprt/commands/make_tiny.py (`python tools/make_tiny.py --help`)."""

import sys

from eprt.commands.make_tiny import main

if __name__ == "__main__":
    sys.exit(main())
