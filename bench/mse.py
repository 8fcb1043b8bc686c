"""`--algorithm mse` against `max`: the quantized weights' squared error and the export's time.

    OMP_NUM_THREADS=1 python bench/mse.py [--family qwen3_moe] [--recipes fp8 nvfp4] [--repeat 2]

The built-in tiny model of --family is calibrated once per recipe and algorithm (a few tokens:
the weight scales depend on the weights alone), then exported. Reported per recipe: the sum over
every quantized weight of its squared quantization error against the source weights, mse over
max, and the export's seconds (best of --repeat), mse over max. On a machine other jobs share,
run it under OMP_NUM_THREADS=1: torch's intra-op threads waiting for each other otherwise
dominate the figures.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.recipe import ALGORITHMS  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.hf_utils import read_hf_tensors  # noqa: E402
from tests.test_mse import weight_errors  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="qwen3_moe")
    p.add_argument("--recipes", nargs="+", default=["fp8", "nvfp4"])
    p.add_argument("--repeat", type=int, default=2)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        hf = make_tiny(args.family, os.path.join(d, "hf"))
        ck = convert_hf(hf, os.path.join(d, "ck"), progress=False)
        src = read_hf_tensors(hf)
        print(f"tiny {args.family}; export time best of {args.repeat}")
        for recipe in args.recipes:
            error, seconds = {}, {}
            for a in ALGORITHMS:
                q = os.path.join(d, f"{recipe}-{a}")
                run_ptq(
                    ParallelState.single(),
                    PTQArgs(ck, recipe, q, calib_size=2, seq_len=16, algorithm=a, progress=False),
                )
                times = []
                for _ in range(args.repeat):
                    start = time.perf_counter()
                    out = export_hf(q, q + "-hf", overwrite=True, progress=False)
                    times.append(time.perf_counter() - start)
                error[a], seconds[a] = sum(weight_errors(out, src).values()), min(times)
            print(
                f"  {recipe:>6}: weight squared error mse/max {error['mse'] / error['max']:.3f}; "
                f"export {seconds['mse']:.2f} s vs {seconds['max']:.2f} s ({seconds['mse'] / seconds['max']:.1f}x)"
            )


if __name__ == "__main__":
    main()
