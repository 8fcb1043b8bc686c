"""The cost of checking a calibrated checkpoint's base weights against their pins, beside an export.

    python bench/base_pin.py [--layers 4] [--hidden 512] [--experts 32] [--width 256] [--iters 3]

One random Qwen3-MoE (bench/ep.py's model) is converted and calibrated (FP8, a few tokens); then,
in this process, the pin check (`eprt.storage.pins.check_weight_pins`: a stat, the header and 16
sampled 4 KiB blocks of every base weight file) and the FP8 export of the calibrated checkpoint
are each timed (best of --iters). The files are in the page cache for both; on a cold disk the
check costs one small read per sample, the export reads every byte.
"""

import argparse
import os
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ep import make_checkpoint  # noqa: E402
from bench.timing import timed  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402
from eprt.storage.pins import check_weight_pins  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--width", type=int, default=256, help="moe_intermediate_size")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()
    cpu = torch.device("cpu")
    with tempfile.TemporaryDirectory() as d:
        ck = make_checkpoint(args, d)
        cal = os.path.join(d, "cal")
        run_ptq(ParallelState.single("cpu"), PTQArgs(ck, "fp8", cal, calib_size=2, seq_len=16, progress=False))
        with Checkpoint(cal) as c:
            pinned = c.manifest["base"]["weights"]
            check_s = timed(lambda: check_weight_pins(cal, c.base, pinned), cpu, args.iters)
        out = os.path.join(d, "export")
        export_s = timed(lambda: export_hf(cal, out, overwrite=True, progress=False), cpu, args.iters)
        size = sum(os.path.getsize(os.path.join(ck, f)) for f in pinned)
    print(
        f"base: {len(pinned)} weight files, {size / 2**20:.1f} MiB (Qwen3-MoE {args.layers} layers, hidden "
        f"{args.hidden}, {args.experts} experts x {args.width})"
    )
    print(
        f"pin check {check_s * 1e3:.2f} ms, FP8 export {export_s * 1e3:.1f} ms: "
        f"check / export = {check_s / export_s:.1e}"
    )


if __name__ == "__main__":
    main()
