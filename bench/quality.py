"""What each weight algorithm buys: the quality report's KL and top-1 for max, mse and gptq, and what each costs.

    python bench/quality.py [--models bench deepseek_v3 kimi_k3] [--recipes nvfp4 fp8] [--calib-size 32] ...

Each model is calibrated in one process with every algorithm on the same data (FP8 KV cache),
and exported; the quality report of each run (docs/quality.md: --eval-size sequences held out
of the calibration data) gives the mean per-token KL(unquantized || quantized), its 99th
percentile and the top-1 agreement. Reported per model and recipe: those figures for each
algorithm, and the PTQ and export seconds relative to max's (mse searches at export, gptq
solves during calibration). Models: `bench` is bench/ep.py's random Qwen3-MoE, the others the
built-in tiny models (eprt-make-tiny). Random weights make KL small in absolute terms; the
ratios between algorithms are the figure to read.
"""

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ep import add_model_args, make_checkpoint  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.quant.recipe import ALGORITHMS  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402


def checkpoint(model: str, args, directory: str) -> str:
    if model == "bench":
        return make_checkpoint(args, directory)
    hf = make_tiny(model, os.path.join(directory, "hf"))
    return convert_hf(hf, os.path.join(directory, "ck"), progress=False)


def run(ck: str, recipe: str, algorithm: str, args, directory: str) -> dict:
    out = os.path.join(directory, f"{recipe}-{algorithm}")
    start = time.perf_counter()
    result = run_ptq(
        ParallelState.single(),
        PTQArgs(
            ck,
            recipe,
            out,
            kv_cache="fp8",
            calib_size=args.calib_size,
            seq_len=args.seq_len,
            eval_size=args.eval_size,
            algorithm=algorithm,
            progress=False,
        ),
    )
    ptq_s = time.perf_counter() - start
    start = time.perf_counter()
    export_hf(out, out + "-hf", progress=False)
    return {"quality": result["quality"], "ptq_s": ptq_s, "export_s": time.perf_counter() - start}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["bench", "deepseek_v3", "kimi_k3"])
    p.add_argument("--recipes", nargs="+", default=["nvfp4", "fp8"])
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-size", type=int, default=8)
    add_model_args(p)
    args = p.parse_args()

    print(
        f"{args.calib_size} x {args.seq_len} calibration tokens, {args.eval_size} held-out sequences, FP8 KV, "
        f"1 process, {os.cpu_count()} CPUs; bench model: Qwen3-MoE {args.layers} layers, hidden {args.hidden}, "
        f"{args.experts} experts top-{args.topk}, width {args.width}, {args.dtype}"
    )
    print(
        f"{'model':<12} {'recipe':<6} {'algorithm':<9} {'KL mean':>9} {'KL/max':>7} {'KL p99':>9} {'top-1':>7} "
        f"{'ptq/max':>8} {'export/max':>10}"
    )
    for model in args.models:
        with tempfile.TemporaryDirectory() as d:
            ck = checkpoint(model, args, d)
            for recipe in args.recipes:
                runs = {a: run(ck, recipe, a, args, d) for a in ALGORITHMS}
                base = runs["max"]
                for algorithm, r in runs.items():
                    q = r["quality"]
                    print(
                        f"{model:<12} {recipe:<6} {algorithm:<9} {q['kl_mean']:>9.3g} "
                        f"{q['kl_mean'] / base['quality']['kl_mean']:>7.3f} {q['kl_p99']:>9.3g} "
                        f"{100 * q['top1_agreement']:>6.2f}% {r['ptq_s'] / base['ptq_s']:>8.2f} "
                        f"{r['export_s'] / base['export_s']:>10.2f}"
                    )


if __name__ == "__main__":
    main()
