"""How well the dry run's time estimate and the calibration's progress bar foretell the run's time.

    python bench/estimate.py [--algorithm gptq] [--calib-size 32] [--seq-len 128] [--layers 8] [--world 2] ...

One random Qwen3-MoE of like layers (bench/ep.py's model). First the dry run's estimate
(`eprt-ptq --dry-run --estimate-time`, its probe on this machine), then the calibration itself:
- at world 1, in this process: at each layer boundary the bar's remaining time (the steps left at the average
  rate since the start: eprt.progress.bar) gives a predicted end; printed for each layer, the bar's predicted
  calibration time and the dry run's against the measured one, as ratios (1.00: exact);
- at a world of several ranks (CPU processes on gloo), the run as `eprt-ptq --nproc-per-node N` does it: the
  dry run's estimate, and its token exchange term, against the run's own calibration time.
"""

import argparse
import os
import re
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from bench.ep import add_model_args, make_checkpoint  # noqa: E402

PTQ = os.path.join(REPO, "tools", "ptq.py")


def ptq(world: int, ck: str, args, *extra: str) -> str:
    """Run tools/ptq.py on `world` local ranks (one: no launcher); its stdout and stderr."""
    launch = ["--nproc-per-node", str(world)] if world > 1 else []
    cmd = [sys.executable, PTQ, *launch, ck, "--recipe", args.recipe, "--algorithm", args.algorithm]
    cmd += ["--calib-size", str(args.calib_size), "--seq-len", str(args.seq_len), *extra]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{p.stderr[-3000:]}")
    return p.stdout + p.stderr


def dry_run_estimate(world: int, ck: str, args) -> tuple[float, float, str]:
    """The dry run's estimate in seconds, its token exchange's part and the line it printed."""
    out = ptq(world, ck, args, "--dry-run", "--estimate-time")
    line = next(line for line in out.splitlines() if line.startswith("calibration time on"))
    exchange = re.search(r"token exchange (\d+) steps x ([\d.e+-]+) s", line)
    return (
        float(re.search(r"about ([\d.]+) s", line).group(1)),
        (int(exchange.group(1)) * float(exchange.group(2)) if exchange else 0.0),
        line,
    )


def with_bar(ck: str, out: str, args) -> list[tuple[float, float]]:
    """Calibrate in this process; (seconds since the bar started, the bar's remaining seconds) after each layer."""
    from eprt.parallel import ParallelState
    from eprt.quant.loop.engine import LayerEngine
    from eprt.quant.run.ptq import PTQArgs, run_ptq

    os.environ["RANK"] = "0"  # the bar counts on rank 0 only
    boundaries = []
    run_layer = LayerEngine.run_layer

    def recording(self, i, ls, pb):
        ls = run_layer(self, i, ls, pb)
        elapsed = time.time() - pb.start_t
        boundaries.append((elapsed, (pb.total - pb.n) * elapsed / pb.n))
        return ls

    LayerEngine.run_layer = recording
    run_ptq(
        ParallelState.single(),
        PTQArgs(
            ck,
            args.recipe,
            out,
            algorithm=args.algorithm,
            calib_size=args.calib_size,
            seq_len=args.seq_len,
            progress=True,
        ),
    )
    return boundaries


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--algorithm", default="gptq")
    p.add_argument("--recipe", default="nvfp4")
    p.add_argument("--calib-size", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--world", type=int, default=1, help="ranks (CPU processes); above 1 the bar is not followed")
    add_model_args(p)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as d:
        ck = make_checkpoint(args, d)
        estimate, exchange, line = dry_run_estimate(args.world, ck, args)
        print(f"dry run: {line}")
        head = (
            f"{args.algorithm}, world {args.world}, {args.layers} layers (hidden {args.hidden}, {args.experts} "
            f"experts of width {args.width}), {args.calib_size} x {args.seq_len} tokens: calibrated in"
        )
        if args.world > 1:
            out = ptq(args.world, ck, args, "--out", os.path.join(d, "q"))
            measured = float(re.search(r"calibrated \d+ tokens in ([\d.]+) s", out).group(1))
            exchanged = re.findall(r"exchanged ([\d.]+) MiB", out)
            print(f"{head} {measured:.1f} s; the dry run's estimate {estimate:.1f} s, ratio {estimate / measured:.2f}")
            print(
                f"  of it the token exchange {exchange:.2f} s ({exchange / measured:.1%} of the run); rank 0 "
                f"exchanged {sum(map(float, exchanged)):.1f} MiB over {len(exchanged)} layers"
            )
            return
        boundaries = with_bar(ck, os.path.join(d, "q"), args)
    measured = boundaries[-1][0]
    print(f"{head} {measured:.1f} s; the dry run's estimate {estimate:.1f} s, ratio {estimate / measured:.2f}")
    for i, (elapsed, remaining) in enumerate(boundaries[:-1]):
        print(
            f"  after layer {i}: the bar foretells {elapsed + remaining:.1f} s, ratio "
            f"{(elapsed + remaining) / measured:.2f}; to the dry run's {(elapsed + remaining) / estimate:.2f}"
        )


if __name__ == "__main__":
    main()
