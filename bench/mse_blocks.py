"""`mse` against `max` on one large weight of the block-scaled formats (FP8 block and per channel,
MXFP8, MXFP4): the quantization's seconds and the weight's squared error, mse over max.

    OMP_NUM_THREADS=1 python bench/mse_blocks.py [--shape 2048 7168] [--repeat 3]

A random bf16 weight (normal, seed 0) is quantized by each format's export `quantize` under max and
under mse in turn, each --repeat times; the best time of each is reported. The export's time on a
model (the rest of the export included) is measured by timing `eprt-export --recipe R --algorithm
mse` against `--algorithm max` side by side.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eprt.quant.formats import weight_format  # noqa: E402

FORMATS = ("fp8_block", "fp8_channel", "mxfp8", "mxfp4")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shape", type=int, nargs=2, default=[2048, 7168], metavar=("OUT", "IN"))
    p.add_argument("--repeat", type=int, default=3)
    args = p.parse_args()
    w = torch.randn(*args.shape, generator=torch.Generator().manual_seed(0)).bfloat16()
    x = w.double()
    print(f"bf16 weight {args.shape[0]} x {args.shape[1]}, best of {args.repeat}, {torch.get_num_threads()} thread(s)")
    for name in FORMATS:
        fmt = weight_format(name)
        scale = fmt.scale(w.abs().amax().float())
        seconds, error = {False: [], True: []}, {}
        for _ in range(args.repeat):
            for mse in (False, True):  # in turn, so a drift of the machine's speed reaches both
                start = time.perf_counter()
                t = fmt.quantize(w, scale, mse)
                seconds[mse].append(time.perf_counter() - start)
                error[mse] = (fmt.dequantize(t, torch.float64) - x).square().sum().item()
        fast, slow = min(seconds[False]), min(seconds[True])
        print(
            f"  {name:>11}: squared error mse/max {error[True] / error[False]:.4f}; "
            f"quantize {slow:.2f} s vs {fast:.2f} s ({slow / fast:.1f}x)"
        )


if __name__ == "__main__":
    main()
