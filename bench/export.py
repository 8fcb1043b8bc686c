"""Quantized export against the plain export of the same checkpoint: how close to the disk's speed.

    python bench/export.py [--recipes fp8 nvfp4] [--layers 4] [--hidden 512] [--experts 32] ...

One random Qwen3-MoE (bench/ep.py's model) is calibrated once per recipe in one process (a few
tokens: the scales do not change the work), then exported, side by side with the unquantized
export of the base checkpoint, which reads and writes the same source bytes without
quantizing anything. Reported per recipe: the seconds of each and their ratio (1.0 = the
quantized export costs no more than moving the bytes), best of --repeat runs.
On a machine other jobs share, run it under OMP_NUM_THREADS=1 (also for a baseline run side
by side): torch's intra-op threads waiting for each other otherwise dominate the figures.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ep import add_model_args, make_checkpoint  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402


def best_export_s(ck: str, out: str, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        export_hf(ck, out, overwrite=True, progress=False)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipes", nargs="+", default=["fp8", "nvfp4"])
    p.add_argument("--repeat", type=int, default=2)
    add_model_args(p)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as d:
        ck = make_checkpoint(args, d)
        plain = best_export_s(ck, os.path.join(d, "plain"), args.repeat)
        print(
            f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts of width {args.width}, "
            f"{args.dtype}; best of {args.repeat}"
        )
        print(f"  unquantized export: {plain:.2f} s")
        for recipe in args.recipes:
            q = os.path.join(d, f"q-{recipe}")
            run_ptq(
                ParallelState.single(),
                PTQArgs(ck, recipe, q, kv_cache="fp8", calib_size=2, seq_len=16, dtype=args.dtype, progress=False),
            )
            s = best_export_s(q, os.path.join(d, f"out-{recipe}"), args.repeat)
            print(f"  {recipe:>6} export:      {s:.2f} s  ({s / plain:.2f}x the unquantized export)")


if __name__ == "__main__":
    main()
