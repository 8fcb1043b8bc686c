"""The format search against a shipped mixed recipe, and its KL against bits.

    python bench/auto_quantize.py HF_DIR --calib CALIB --eval EVAL [--budgets 4.6 5 6 8] [--algorithm gptq] ...

HF_DIR is a trained Qwen3-MoE (random weights make every format look alike); CALIB and EVAL its
calibration and held-out data. In one process, with the same data:
1. `nvfp4_experts_fp8_attention` calibrated as shipped: its effective bits per active parameter
   (eprt.quant.algorithms.search.auto_quantize) and the quality report's mean KL on the held-out sequences;
2. `--auto-quantize` at exactly those bits: the KL it estimates and the KL its export measures,
   and its time (the search with the calibration of its choice) over the shipped recipe's PTQ
   time, both in wall and in CPU seconds of this process;
3. a sweep of budgets (none with `--budgets` alone): the choice at each from the same search's
   errors (the errors do not depend on the budget), calibrated with the chosen recipe, its
   estimated and measured KL.
`--algorithm` calibrates both runs and the sweep with it (the search measures with max under
GPTQ and AWQ).
Every figure is the quality report's mean per-token KL(unquantized || quantized) over the
--eval-size held-out sequences (the search measures its errors on the calibration ones; only the
estimate's constant comes from the held-out KL).
"""

import argparse
import json
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.loading.resolved import ResolvedCheckpoint  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.algorithms.search.auto_quantize import RECIPE_FILE, SearchSpace, parse_candidates  # noqa: E402
from eprt.quant.recipe import load_recipe  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.quant.run.setup import run_dtype  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402

SHIPPED = "nvfp4_experts_fp8_attention"


def ptq(ck: str, out: str, args, **change) -> dict:
    a = PTQArgs(
        ck,
        None,
        out,
        calib=(args.calib,),
        eval=args.eval,
        calib_size=args.calib_size,
        seq_len=args.seq_len,
        eval_size=args.eval_size,
        auto_quantize_formats=args.formats,
        algorithm=args.algorithm,
        progress=False,
    )
    return run_ptq(ParallelState.single(), PTQArgs(**{**a.__dict__, **change}))["quality"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("hf", help="a trained model's Hugging Face directory")
    p.add_argument("--calib", required=True)
    p.add_argument("--eval", required=True)
    p.add_argument("--calib-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--eval-size", type=int, default=16)
    p.add_argument("--formats", default="nvfp4,fp8,none")
    p.add_argument("--budgets", nargs="*", type=float, default=[4.6, 4.8, 5.0, 5.5, 6.0, 7.0, 8.0, 10.0])
    p.add_argument("--algorithm", default="max")
    args = p.parse_args()
    print(
        f"{args.calib_size} x {args.seq_len} calibration tokens, {args.eval_size} x {args.seq_len} held-out tokens, "
        f"formats {args.formats}, --algorithm {args.algorithm}, 1 process, {os.cpu_count()} CPUs"
    )
    with tempfile.TemporaryDirectory() as d:
        ck = convert_hf(args.hf, os.path.join(d, "ck"), progress=False)
        with Checkpoint(ck) as opened:
            c = opened.config
            space = SearchSpace.of(
                ResolvedCheckpoint.of(opened, run_dtype("bf16")).layout,
                parse_candidates(args.formats),
                c.num_experts_per_tok,
                c.num_experts,
            )
        shipped_bits = space.effective_bits(space.of_recipe(load_recipe(SHIPPED)))
        start, cpu = time.perf_counter(), time.process_time()
        shipped = ptq(ck, os.path.join(d, "shipped"), args, recipe=SHIPPED)
        shipped_s, shipped_cpu = time.perf_counter() - start, time.process_time() - cpu
        start, cpu = time.perf_counter(), time.process_time()
        searched = ptq(ck, os.path.join(d, "auto"), args, auto_quantize=shipped_bits)["auto_quantize"]
        searched_s, searched_cpu = time.perf_counter() - start, time.process_time() - cpu
        print(f"{'run':<28} {'bits':>6} {'KL estimated':>12} {'KL measured':>12}")
        print(f"{SHIPPED:<28} {shipped_bits:>6.3f} {'':>12} {shipped['kl_mean']:>12.5f}")
        row = f"{'--auto-quantize ' + format(shipped_bits, '.3f'):<28} {searched['effective_bits']:>6.3f}"
        print(f"{row} {searched['estimated_kl']:>12.5f} {searched['measured_kl']:>12.5f}")
        print(f"  KL ratio search / shipped: {searched['measured_kl'] / shipped['kl_mean']:.3f}")
        chosen = [e["format"] for e in searched["map"]]
        print(f"  the choice: {json.dumps({f: chosen.count(f) for f in space.candidates})} {' '.join(chosen)}")
        print(f"  PTQ seconds search / shipped: {searched_s / shipped_s:.2f} ({searched_s:.1f} s / {shipped_s:.1f} s)")
        print(
            f"  PTQ CPU seconds search / shipped: {searched_cpu / shipped_cpu:.2f} "
            f"({searched_cpu:.1f} s / {shipped_cpu:.1f} s)"
        )
        errors = {(e["group"], f): v for e in searched["map"] for f, v in e["errors"].items()}
        shipped_estimate = searched["kl_per_error"] * space.loss(space.of_recipe(load_recipe(SHIPPED)), errors)
        print(f"  the shipped recipe's map, estimated: {shipped_estimate:.5f}")
        for budget in args.budgets:
            choice = space.choose(budget, errors)
            path = os.path.join(d, f"{budget:g}.yaml")
            with open(path, "w", encoding="utf-8") as f:
                f.write(space.recipe_yaml(choice, None, budget, args.algorithm))
            q = ptq(ck, os.path.join(d, f"sweep-{budget:g}"), args, recipe=path)
            estimated = searched["kl_per_error"] * space.loss(choice, errors)
            formats = json.dumps({f: sum(v == f for v in choice.values()) for f in space.candidates})
            print(
                f"{'budget ' + format(budget, 'g'):<28} {space.effective_bits(choice):>6.3f} {estimated:>12.5f} "
                f"{q['kl_mean']:>12.5f}  groups {formats}"
            )
        print(f"(the chosen recipe of a run is OUT/{RECIPE_FILE})")


if __name__ == "__main__":
    main()
