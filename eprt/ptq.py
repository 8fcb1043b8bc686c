"""The ptq command as a short module name, for `torchrun --nproc-per-node N -m eprt.ptq CKPT ...`
(the command itself is eprt/commands/ptq.py)."""

import sys

from eprt.commands.ptq import main

if __name__ == "__main__":
    sys.exit(main())
