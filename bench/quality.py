"""What each weight algorithm buys: the quality report's KL and top-1 for each algorithm, and what each costs.

    python bench/quality.py [--models bench deepseek_v3 kimi_k3] [--recipes nvfp4 fp8] [--calib-size 32] ...
    python bench/quality.py --hf TRAINED_HF_DIR --calib CALIB.jsonl --eval EVAL.txt --recipes nvfp4_a16 nvfp4 \
        --calib-size 64 --seq-len 256 --eval-size 64

Each model is calibrated in one process with every algorithm on the same data (FP8 KV cache),
and exported; the quality report of each run (docs/quality.md: --eval-size sequences held out
of the calibration data) gives the mean per-token KL(unquantized || quantized), its 99th
percentile and the top-1 agreement. Reported per model and recipe: those figures for each
algorithm, and the PTQ and export seconds relative to max's (mse searches at export, gptq
solves during calibration). Models: `bench` is bench/ep.py's random Qwen3-MoE, the others the
built-in tiny models (eprt-make-tiny). Random weights make KL small in absolute terms; the
ratios between algorithms are the figure to read.

With --hf, the model is that Hugging Face checkpoint (a trained one: there quantization error is
real), calibrated on --calib and scored on --eval (the quality report's --eval: held-out text), and
the table also gives the perplexity of the quantized model and the seconds of each run. For AWQ's
runs, `flips` is the report's `router_flips`: the share of the routers' top-k choices on the
held-out tokens that AWQ's folds alone change (docs/quality.md).
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
from eprt.quant.recipe import ALGORITHMS  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402


def checkpoint(model: str, args, directory: str) -> str:
    if model == args.hf:
        return convert_hf(model, os.path.join(directory, "ck"), progress=False)
    if model == "bench":
        return make_checkpoint(args, directory)
    hf = make_tiny(model, os.path.join(directory, "hf"))
    return convert_hf(hf, os.path.join(directory, "ck"), progress=False)


def run(ck: str, recipe: str, algorithm: str, args, directory: str) -> dict:
    # a recipe given as a path is named by its file's stem
    out = os.path.join(directory, f"{os.path.splitext(os.path.basename(recipe))[0]}-{algorithm}")
    start = time.perf_counter()
    result = run_ptq(
        ParallelState.single(),
        PTQArgs(
            ck,
            recipe,
            out,
            kv_cache=args.kv_cache,
            calib=(args.calib,) if args.calib else (),
            eval=args.eval,
            calib_size=args.calib_size,
            seq_len=args.seq_len,
            eval_size=args.eval_size,
            algorithm=algorithm,
            progress=False,
        ),
    )
    ptq_s = time.perf_counter() - start
    start = time.perf_counter()
    export_hf(out, out + "-hf", progress=False, fmt=args.export_format)
    export_s = time.perf_counter() - start
    return {
        "export": out + "-hf",
        "quality": result["quality"],
        "ptq_s": ptq_s,
        "calibration_s": result["calibration_s"],
        "export_s": export_s,
        "router_flips": result["quality"].get("router_flips"),  # AWQ's: the choices its folds changed
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["bench", "deepseek_v3", "kimi_k3"])
    p.add_argument("--recipes", nargs="+", default=["nvfp4", "fp8"])
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--eval-size", type=int, default=8)
    p.add_argument("--algorithms", nargs="+", default=list(ALGORITHMS), choices=ALGORITHMS)
    p.add_argument("--hf", help="a Hugging Face checkpoint to score, in place of --models")
    p.add_argument("--calib", help="calibration data (default: the built-in corpus)")
    p.add_argument("--eval", help="held-out data the quality report scores on (default: held out of --calib)")
    p.add_argument("--kv-cache", default="fp8", help="fp8, or none")
    p.add_argument("--export-format", help="the export's layout (default: the recipe's; int4 needs compressed-tensors)")
    add_model_args(p)
    args = p.parse_args()
    args.kv_cache = None if args.kv_cache == "none" else args.kv_cache
    if args.hf:
        args.models = [args.hf]
    if "max" not in args.algorithms:
        p.error("--algorithms: give max too, the baseline of the ratios")

    models = (
        args.hf
        if args.hf
        else f"bench model: Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
        f"top-{args.topk}, width {args.width}, {args.dtype}"
    )
    print(
        f"{args.calib_size} x {args.seq_len} calibration tokens, {args.eval_size} held-out sequences, "
        f"KV cache {args.kv_cache or 'unquantized'}, 1 process, {os.cpu_count()} CPUs; {models}"
    )
    print(
        f"{'model':<12} {'recipe':<9} {'algorithm':<9} {'KL mean':>9} {'KL/max':>7} {'KL p99':>9} {'top-1':>7} "
        f"{'ppl':>7} {'cal s':>6} {'cal/max':>7} {'export s':>8} {'export/max':>10} {'flips':>7}"
    )
    for model in args.models:
        with tempfile.TemporaryDirectory() as d:
            ck = checkpoint(model, args, d)
            for recipe in args.recipes:
                runs = {a: run(ck, recipe, a, args, d) for a in args.algorithms}
                base = runs["max"]
                if recipe == args.recipes[0] and model == args.models[0]:
                    print(f"unquantized perplexity {base['quality']['perplexity']['unquantized']:.3f}")
                for algorithm, r in runs.items():
                    q = r["quality"]
                    print(
                        f"{os.path.basename(model.rstrip('/'))[:12]:<12} {recipe:<9} {algorithm:<9} "
                        f"{q['kl_mean']:>9.4g} {q['kl_mean'] / base['quality']['kl_mean']:>7.3f} {q['kl_p99']:>9.4g} "
                        f"{100 * q['top1_agreement']:>6.2f}% {q['perplexity']['quantized']:>7.3f} "
                        f"{r['calibration_s']:>6.1f} {r['calibration_s'] / base['calibration_s']:>7.2f} "
                        f"{r['export_s']:>8.1f} {r['export_s'] / base['export_s']:>10.2f} "
                        + (f"{100 * r['router_flips']:>6.3f}%" if r["router_flips"] is not None else f"{'':>7}")
                    )


if __name__ == "__main__":
    main()
