"""The work directory's saves written while the next layer computes, against a tree that writes them
before it goes on: calibration time and peak RSS, side by side in one run (CPU, ep 1).

    mkdir /tmp/eprt-base && git archive BASE_COMMIT | tar -x -C /tmp/eprt-base   # the tree to compare against
    python bench/work_dir_overlap.py --baseline /tmp/eprt-base [--calib-size 16] [--seq-len 256] [--repeats 2]

The model is modelopt_baseline.py's (8 layers x 32 experts, hidden 1024: ~0.9 GB in bf16); each side
calibrates NVFP4 + FP8 KV (max) on the same text (the quality report on) with its own tree's tools/ptq.py, a save after
every layer, in a fresh process, the sides taking turns. Reported per side: the calibration's seconds
(the run's own "calibrated N tokens in S s": the layer loop with its saves) and the peak RSS, the
median of the repeats, and this tree's over the baseline's.
"""

import argparse
import json
import os
import random
import re
import shutil
import statistics
import string
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.ep import MiB  # noqa: E402
from bench.modelopt_baseline import WALL_CHILD  # noqa: E402


def calibrate(tree: str, ck: str, calib: str, out: str, args) -> dict:
    """One run of `tree`'s tools/ptq.py in a fresh process: its calibration seconds and peak RSS."""
    ptq = [os.path.join(tree, "tools", "ptq.py"), ck, "--recipe", "nvfp4", "--kv-cache", "fp8", "--calib", calib]
    ptq += ["--calib-size", str(args.calib_size), "--seq-len", str(args.seq_len), "--out", out]
    r = subprocess.run(
        [sys.executable, "-c", WALL_CHILD, sys.executable, *ptq],
        capture_output=True,
        text=True,
        cwd=tree,
        env={**os.environ, "PYTHONPATH": tree},
    )
    if r.returncode:
        raise SystemExit(f"{tree}: tools/ptq.py failed:\n{r.stderr[-4000:]}")
    run = json.loads(r.stdout.strip().splitlines()[-1])
    seconds = float(re.search(r"calibrated \d+ tokens in ([\d.]+) s", run["stderr"]).group(1))
    return {"seconds": seconds, "peak": run["peak"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--baseline", required=True, help="a checkout of the tree to compare against")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--width", type=int, default=576, help="moe_intermediate_size")
    p.add_argument("--vocab", type=int, default=512)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--calib-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args()

    from bench.ep import make_checkpoint

    sides = {"baseline": os.path.realpath(args.baseline), "this tree": ROOT}
    runs = {name: [] for name in sides}
    with tempfile.TemporaryDirectory() as d:
        ck = make_checkpoint(args, d)
        # text, not token ids: the quality report of an ids source is refused by the export's own check
        rng = random.Random(0)
        words = ["".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(2, 8))) for _ in range(2000)]
        calib = os.path.join(d, "calib.txt")
        with open(calib, "w") as f:
            f.write(" ".join(rng.choice(words) for _ in range(40 * (args.calib_size + 8) * args.seq_len)))
        for i in range(args.repeats):
            for name, tree in sides.items():
                out = os.path.join(d, "q")
                runs[name].append(calibrate(tree, ck, calib, out, args))
                shutil.rmtree(out)

    print(
        f"Qwen3-MoE {args.layers} layers x {args.experts} experts top-{args.topk}, hidden {args.hidden}, "
        f"{args.dtype}; NVFP4 + FP8 KV, max, {args.calib_size} x {args.seq_len} tokens, ep 1, a save after every "
        f"layer; median of {args.repeats}, the sides taking turns; {os.cpu_count()} CPUs"
    )
    median = {n: {k: statistics.median(r[k] for r in rs) for k in ("seconds", "peak")} for n, rs in runs.items()}
    base, this = median["baseline"], median["this tree"]
    print(f"{'':<22}{'baseline':>12}{'this tree':>12}{'ratio':>8}")
    print(
        f"{'calibration s':<22}{base['seconds']:>12.2f}{this['seconds']:>12.2f}{this['seconds'] / base['seconds']:>8.3f}"
    )
    print(
        f"{'peak RSS MiB':<22}{base['peak'] / MiB:>12.0f}{this['peak'] / MiB:>12.0f}{this['peak'] / base['peak']:>8.3f}"
    )
    print("each run:", json.dumps(runs))


if __name__ == "__main__":
    main()
