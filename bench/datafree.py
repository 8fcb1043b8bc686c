"""The data-free path against the unquantized export of the same model, side by side: wall seconds
and peak memory, as ratios.

    python bench/datafree.py [--recipe fp8_block | --recipe all] [--baseline DIR] [--no-ptq] [--runs 5] \
        [--layers 4] [--hidden 512] [--experts 32] ...

One random Qwen3-MoE (bench/ep.py's model) is converted once. Then, for each recipe in turn and run
by run (A B C, A B C, ...), each as fresh processes, as a user runs them:
- ptq + export: `eprt-ptq CK --recipe R --out Q` (data-free: no data, no forward pass), then
  `eprt-export Q OUT` (left out under --no-ptq);
- direct: `eprt-export CK OUT --recipe R`;
- direct, baseline: the same command run from the eprt tree at --baseline DIR (the code before a
  change, say `git archive BASE | tar -x -C DIR`), so that before and after are timed in one run;
- unquantized: `eprt-export CK OUT`, which reads and writes the same source bytes and quantizes
  nothing: the disk's (and the page cache's) speed for this model.
A recipe whose formats the ModelOpt layout does not hold (INT4, MXFP4) exports compressed-tensors'.
`--recipe all`: every shipped data-free recipe. Reported per recipe: each one's median wall and CPU
(user + system) seconds and peak RSS (of its largest process; the operating system's own
accounting), and the medians of the ratios to the unquantized export taken run by run, so that a
drift of the machine's speed moves both sides; with --baseline, the direct export's to the
baseline's, the same way. Beside them, the dry run's planned peak of the
export. On a machine other jobs share, run it under OMP_NUM_THREADS=1.
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MiB = 2**20
# A child's peak RSS starts from its parent's at the fork (Linux keeps the high-water mark across
# exec), so this process imports nothing large: the model is made, and the recipes are read, in
# children of their own.
MAKE = (
    "import sys; from bench.datafree import parser; from bench.ep import make_checkpoint; "
    "make_checkpoint(parser().parse_args(sys.argv[2:]), sys.argv[1])"
)
# each data-free shipped recipe and its export layout
RECIPES = (
    "from eprt.quant.run.datafree import statistics_needed; from eprt.quant.formats import weight_format; "
    "from eprt.quant.recipe import available, load_recipe\n"
    "for name in available():\n"
    "    r = load_recipe(name)\n"
    "    if not statistics_needed(r):\n"
    "        ct = not all(weight_format(f).modelopt_layout for f in r.formats)\n"
    "        print(name, 'compressed-tensors' if ct else 'modelopt')"
)


def env(root: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def parser() -> argparse.ArgumentParser:
    from bench.ep import add_model_args  # in the child that makes the model (MAKE)

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", action="append", help="a data-free recipe, several times, or all (default fp8_block)")
    p.add_argument("--baseline", help="an eprt tree whose direct export is timed beside this one's")
    p.add_argument("--no-ptq", action="store_true", help="leave out ptq + export")
    p.add_argument("--runs", type=int, default=5)
    add_model_args(p)
    return p


def timed(root: str, *commands: list[str]) -> tuple[float, float, int]:
    """Wall and CPU (user + system) seconds of `commands` run one after the other from the eprt
    tree at `root`, and the largest peak RSS among them."""
    peak, cpu, start = 0, 0.0, time.perf_counter()
    for cmd in commands:
        # run from `root`: `python -m` looks in the working directory before PYTHONPATH
        proc = subprocess.Popen(
            [sys.executable, "-m", *cmd], env=env(root), cwd=root, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr.read().decode()}")
        proc.stderr.close()
        peak = max(peak, usage.ru_maxrss * 1024)  # Linux reports kB
        cpu += usage.ru_utime + usage.ru_stime
    return time.perf_counter() - start, cpu, peak


def data_free_recipes() -> dict[str, str]:
    out = subprocess.run([sys.executable, "-c", RECIPES], env=env(REPO), cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(out.stderr)
    return dict(line.split() for line in out.stdout.splitlines())


def ways(args, recipe: str, layout: str, ck: str, d: str) -> dict:
    q, out = os.path.join(d, "q"), os.path.join(d, "out")
    export = ["eprt.commands.export", "--no-progress", "--overwrite", "--format", layout]
    plain = ["eprt.commands.export", "--no-progress", "--overwrite"]
    direct = [*export, ck, out, "--recipe", recipe]
    found = {}
    if not args.no_ptq:
        found["ptq + export"] = lambda: timed(
            REPO, ["eprt.commands.ptq", ck, "--recipe", recipe, "--out", q, "--overwrite"], [*export, q, out]
        )
    found["direct export"] = lambda: timed(REPO, direct)
    if args.baseline:
        found["direct, baseline"] = lambda: timed(os.path.abspath(args.baseline), direct)
    found["unquantized export"] = lambda: timed(REPO, [*plain, ck, out])
    return found


def report(name: str, got: list, base: list) -> str:
    wall, cpu, peak = (statistics.median(r[i] for r in got) for i in range(3))
    wall_x, cpu_x, peak_x = (statistics.median(r[i] / b[i] for r, b in zip(got, base)) for i in range(3))
    return (
        f"  {name:>18}: wall {wall:6.2f} s, cpu {cpu:6.2f} s, peak {peak / MiB:5.0f} MiB  "
        f"({wall_x:.2f}x the wall, {cpu_x:.2f}x the cpu, {peak_x:.2f}x the peak of the unquantized export)"
    )


def against_baseline(got: list, base: list) -> str:
    """The direct export against the baseline tree's, run by run: the medians of the ratios."""
    wall_x, cpu_x, peak_x = (statistics.median(r[i] / b[i] for r, b in zip(got, base)) for i in range(3))
    return f"  {'direct / baseline':>18}: {wall_x:.2f}x the wall, {cpu_x:.2f}x the cpu, {peak_x:.2f}x the peak"


def main() -> None:
    sys.path.insert(0, REPO)
    args = parser().parse_args()
    shipped = data_free_recipes()
    asked = args.recipe or ["fp8_block"]
    recipes = list(shipped) if asked == ["all"] else asked
    unknown = [r for r in recipes if r not in shipped]
    if unknown:
        raise SystemExit(
            f"--recipe {', '.join(unknown)}: not a shipped data-free recipe; choose among {', '.join(shipped)}"
        )
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-c", MAKE, d, *sys.argv[1:]], env=env(REPO), cwd=REPO, check=True)
        ck = os.path.join(d, "ck")
        plans = {r: ways(args, r, shipped[r], ck, d) for r in recipes}
        runs = {r: {name: [] for name in plans[r]} for r in recipes}
        for i in range(args.runs):
            for r in recipes:
                for name, run in plans[r].items():
                    runs[r][name].append(run())
                # each run's ratios as it ends: a long run on a busy machine shows what it has
                base = runs[r]["unquantized export"][-1][0]
                ratios = ", ".join(f"{name} {got[-1][0] / base:.2f}x" for name, got in runs[r].items())
                print(f"run {i + 1} {r}: wall {ratios} the unquantized export's", file=sys.stderr, flush=True)
        size = sum(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck) if f.endswith(".safetensors"))
        print(
            f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts of width {args.width}, "
            f"{args.dtype} ({size / MiB:.0f} MiB of weights); medians of {args.runs} runs"
        )
        for r in recipes:
            plan = subprocess.run(
                [sys.executable, "-m", "eprt.commands.ptq", ck, "--recipe", r, "--dry-run"],
                env=env(REPO),
                cwd=REPO,
                capture_output=True,
                text=True,
                check=True,
            ).stdout.splitlines()[-1]
            print(f"recipe {r} ({shipped[r]} layout):")
            for name, got in runs[r].items():
                print(report(name, got, runs[r]["unquantized export"]))
            if args.baseline:
                print(against_baseline(runs[r]["direct export"], runs[r]["direct, baseline"]))
            print(f"  dry run: {plan}")


if __name__ == "__main__":
    main()
