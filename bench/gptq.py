"""GPTQ against max rounding: each Linear's layer-output error on its calibration inputs, and time.

    python bench/gptq.py [--recipe nvfp4] [--calib-size 32] [--seq-len 128] [--layers 4] ...

One random Qwen3-MoE (bench/ep.py's model) is calibrated in one process with max and with gptq
on the same data (FP8 KV cache). For every Linear GPTQ ran on, the output error
||X W_q^T - X W^T||^2 over its calibration inputs X (the quantized stream GPTQ saw) is computed
for GPTQ's weight and for max rounding's (the export's encoding of the source weight under the
same scales); reported: the ratio gptq/max (median and worst over dense Linears, median over
routed experts' projections with 256 tokens or more, and how many of those GPTQ improves), and
the calibration times.
"""

import argparse
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ep import add_model_args, make_checkpoint  # noqa: E402
from tests.test_gptq import hessians_of_run, layer_output_errors  # noqa: E402


def main() -> None:
    from eprt.parallel import ParallelState
    from eprt.quant.run.ptq import PTQArgs, run_ptq

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="nvfp4")
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    add_model_args(p)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as d:
        ck = make_checkpoint(args, d)
        seconds = {}
        for algorithm in ("max", "gptq"):
            hessians = hessians_of_run(setattr) if algorithm == "gptq" else None
            seconds[algorithm] = run_ptq(
                ParallelState.single(),
                PTQArgs(
                    ck,
                    args.recipe,
                    os.path.join(d, algorithm),
                    kv_cache="fp8",
                    calib_size=args.calib_size,
                    seq_len=args.seq_len,
                    dtype=args.dtype,
                    algorithm=algorithm,
                    progress=False,
                ),
            )["calibration_s"]
        errors = layer_output_errors(os.path.join(d, "gptq"), hessians)

    dense = [g / m for _, tokens, g, m in errors if tokens is None]
    experts = [g / m for _, tokens, g, m in errors if tokens is not None and tokens >= 256]
    print(
        f"{args.recipe} + FP8 KV on Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
        f"top-{args.topk}, width {args.width}, {args.dtype}; {args.calib_size} x {args.seq_len} tokens, 1 process"
    )
    print(
        f"dense Linears ({len(dense)}): output error gptq/max median {statistics.median(dense):.3f}, "
        f"worst {max(dense):.3f}"
    )
    if experts:
        print(
            f"expert projections with >= 256 tokens ({len(experts)}): gptq/max median "
            f"{statistics.median(experts):.3f}, improved {sum(r < 1 for r in experts)}/{len(experts)}"
        )
    print(
        f"calibration time: max {seconds['max']:.2f} s, gptq {seconds['gptq']:.2f} s "
        f"({seconds['gptq'] / seconds['max']:.1f}x)"
    )


if __name__ == "__main__":
    main()
