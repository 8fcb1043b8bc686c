"""The data-free path against the unquantized export of the same model, side by side: wall seconds
and peak memory, as ratios.

    python bench/datafree.py [--recipe fp8_block] [--runs 5] [--layers 4] [--hidden 512] [--experts 32] ...

One random Qwen3-MoE (bench/ep.py's model) is converted once. Then, in turn (A B C, A B C, ...),
each as fresh processes, as a user runs them:
- ptq + export: `eprt-ptq CK --recipe R --out Q` (data-free: no data, no forward pass), then
  `eprt-export Q OUT`;
- direct: `eprt-export CK OUT --recipe R`;
- unquantized: `eprt-export CK OUT`, which reads and writes the same source bytes and quantizes
  nothing: the disk's (and the page cache's) speed for this model.
Reported: each one's median wall and CPU (user + system) seconds and peak RSS (of its largest
process; the operating system's own accounting), and the medians of the ratios to the unquantized export taken run by
run, so that a drift of the machine's speed moves both sides. Beside them, the dry run's planned
peak of the export. On a machine other jobs share, run it under OMP_NUM_THREADS=1.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
MiB = 2**20
# A child's peak RSS starts from its parent's at the fork (Linux keeps the high-water mark across
# exec), so this process imports nothing large: the model is made in a child of its own.
MAKE = (
    "import sys; from bench.datafree import parser; from bench.ep import make_checkpoint; "
    "make_checkpoint(parser().parse_args(sys.argv[2:]), sys.argv[1])"
)


def parser() -> argparse.ArgumentParser:
    from bench.ep import add_model_args  # in the child that makes the model (MAKE)

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="fp8_block", help="a data-free recipe (default fp8_block)")
    p.add_argument("--runs", type=int, default=5)
    add_model_args(p)
    return p


def timed(*commands: list[str]) -> tuple[float, float, int]:
    """Wall and CPU (user + system) seconds of `commands` run one after the other, and the largest
    peak RSS among them."""
    peak, cpu, start = 0, 0.0, time.perf_counter()
    for cmd in commands:
        proc = subprocess.Popen(
            [sys.executable, "-m", *cmd], env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode()}")
        proc.stderr.close()
        peak = max(peak, usage.ru_maxrss * 1024)  # Linux reports kB
        cpu += usage.ru_utime + usage.ru_stime
    return time.perf_counter() - start, cpu, peak


def main() -> None:
    sys.path.insert(0, REPO)
    args = parser().parse_args()
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-c", MAKE, d, *sys.argv[1:]], env=ENV, cwd=REPO, check=True)
        ck, q, out = os.path.join(d, "ck"), os.path.join(d, "q"), os.path.join(d, "out")
        export = ["eprt.commands.export", "--no-progress", "--overwrite"]
        ways = {
            "ptq + export": lambda: timed(
                ["eprt.commands.ptq", ck, "--recipe", args.recipe, "--out", q, "--overwrite"], [*export, q, out]
            ),
            "direct export": lambda: timed([*export, ck, out, "--recipe", args.recipe]),
            "unquantized export": lambda: timed([*export, ck, out]),
        }
        runs: dict[str, list[tuple[float, float, int]]] = {name: [] for name in ways}
        for _ in range(args.runs):
            for name, run in ways.items():
                runs[name].append(run())
        plan = subprocess.run(
            [sys.executable, "-m", "eprt.commands.ptq", ck, "--recipe", args.recipe, "--dry-run"],
            env=ENV,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.splitlines()[-1]
        size = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck) if f.endswith(".safetensors"))
        print(
            f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts of width {args.width}, "
            f"{args.dtype} ({size / MiB:.0f} MiB of weights); recipe {args.recipe}; medians of {args.runs} runs"
        )
        base = runs["unquantized export"]
        for name, got in runs.items():
            wall, cpu, peak = (statistics.median(r[i] for r in got) for i in range(3))
            wall_x, cpu_x, peak_x = (statistics.median(r[i] / b[i] for r, b in zip(got, base)) for i in range(3))
            print(
                f"  {name:>18}: wall {wall:6.2f} s, cpu {cpu:6.2f} s, peak {peak / MiB:5.0f} MiB  "
                f"({wall_x:.2f}x the wall, {cpu_x:.2f}x the cpu, {peak_x:.2f}x the peak of the unquantized export)"
            )
        print(f"  dry run: {plan}")


if __name__ == "__main__":
    main()
