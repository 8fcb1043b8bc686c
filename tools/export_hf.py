"""`eprt-export` from a clone: see eprt/commands/export.py (`python tools/export_hf.py --help`)."""

import sys

from eprt.commands.export import main

if __name__ == "__main__":
    sys.exit(main())
