"""INT4 weights on a trained model: RTN (max) against GPTQ, in groups of 32 and of 128.

    python bench/int4_quality.py HF_DIR [--calib-size 64] [--seq-len 256] [--eval-size 16]

HF_DIR is a trained Hugging Face checkpoint with `calib.jsonl` (calibration text) and `eval.txt`
(held-out text) beside its weights; random weights make every rounding look alike. It is converted
once and calibrated in one process per (recipe, algorithm) on the same data; the quality report
(docs/quality.md) gives the mean per-token KL(bf16 || quantized) on --eval-size sequences of
eval.txt, its 99th percentile and the top-1 agreement. INT4 leaves the inputs in bf16, so the
figures are the weights' alone. Reported per recipe: those figures for max and gptq, GPTQ's KL
relative to RTN's, and the calibration seconds. `int4_mixed` is groups of 128 where the input dim
allows, the routed experts in groups of 32 (a model whose expert width is below 128, as the trained
test model's 64, cannot be grouped by 128 there).
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402

RECIPES = ("int4_g32", "int4_mixed")
MIXED = {
    "name": "int4_mixed",
    "quantize": [{"pattern": "*.experts", "format": "int4", "group_size": 32}, {"pattern": "*", "format": "int4"}],
}
ALGORITHMS = ("max", "gptq")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("hf_dir")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES))
    p.add_argument("--calib-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-size", type=int, default=16)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        ck = convert_hf(args.hf_dir, os.path.join(d, "ck"), progress=False)
        mixed = os.path.join(d, "int4_mixed.yaml")
        with open(mixed, "w") as f:
            json.dump(MIXED, f)
        for recipe in args.recipes:
            kl = {}
            for algorithm in ALGORITHMS:
                start = time.perf_counter()
                result = run_ptq(
                    ParallelState.single(),
                    PTQArgs(
                        ck,
                        mixed if recipe == "int4_mixed" else recipe,
                        os.path.join(d, f"{recipe}-{algorithm}"),
                        calib=(os.path.join(args.hf_dir, "calib.jsonl"),),
                        calib_size=args.calib_size,
                        seq_len=args.seq_len,
                        eval=os.path.join(args.hf_dir, "eval.txt"),
                        eval_size=args.eval_size,
                        algorithm=algorithm,
                        progress=False,
                    ),
                )
                q = result["quality"]
                kl[algorithm] = q["kl_mean"]
                print(
                    f"{recipe:9s} {algorithm:5s} KL {q['kl_mean']:.4f}  p99 {q['kl_p99']:.4f}  "
                    f"top-1 {100 * q['top1_agreement']:.1f}%  {time.perf_counter() - start:.0f} s",
                    flush=True,
                )
            print(f"{recipe:9s} gptq/max KL {kl['gptq'] / kl['max']:.3f}", flush=True)


if __name__ == "__main__":
    main()
