"""How well the calibration's progress bar foretells the end of the run, layer by layer.

    python bench/estimate.py [--algorithm gptq] [--calib-size 32] [--seq-len 128] [--layers 8] ...

One random Qwen3-MoE of like layers (bench/ep.py's model) is calibrated in one process. At each layer
boundary the bar's remaining time (the steps left at the average rate since the start: eprt.progress.bar)
gives a predicted end; printed for each layer: the predicted calibration time against the measured one,
as a ratio (1.00: exact). The first layer's line is the one a user reads first.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ep import add_model_args, make_checkpoint  # noqa: E402


def main() -> None:
    from eprt.parallel import ParallelState
    from eprt.quant.engine import LayerEngine
    from eprt.quant.ptq import PTQArgs, run_ptq

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algorithm", default="gptq")
    p.add_argument("--recipe", default="nvfp4")
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    add_model_args(p)
    args = p.parse_args()

    os.environ["RANK"] = "0"  # the bar counts on rank 0 only
    boundaries = []  # (seconds since the bar started, the bar's remaining seconds) after each layer
    run_layer = LayerEngine.run_layer

    def recording(self, i, ls, pb):
        ls = run_layer(self, i, ls, pb)
        elapsed = time.time() - pb.start_t
        boundaries.append((elapsed, (pb.total - pb.n) * elapsed / pb.n))
        return ls

    LayerEngine.run_layer = recording
    with tempfile.TemporaryDirectory() as d:
        ck = make_checkpoint(args, d)
        run_ptq(
            ParallelState.single(),
            PTQArgs(
                ck,
                args.recipe,
                os.path.join(d, "q"),
                algorithm=args.algorithm,
                calib_size=args.calib_size,
                seq_len=args.seq_len,
                progress=True,
            ),
        )
    measured = boundaries[-1][0]
    print(
        f"{args.algorithm}, {args.layers} layers (hidden {args.hidden}, {args.experts} experts of width "
        f"{args.width}), {args.calib_size} x {args.seq_len} tokens: calibrated in {measured:.1f} s"
    )
    for i, (elapsed, remaining) in enumerate(boundaries[:-1]):
        print(
            f"  after layer {i}: the bar foretells {elapsed + remaining:.1f} s, ratio "
            f"{(elapsed + remaining) / measured:.2f}"
        )


if __name__ == "__main__":
    main()
