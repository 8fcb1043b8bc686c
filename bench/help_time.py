"""How long each command takes to answer `--help`, as a user's shell sees it: a new process each time.

    python bench/help_time.py [--iters 5]

Each command (`python -m eprt.commands.NAME --help`) is timed beside two baselines run the same
way: the interpreter alone (`python -c pass`) and `python -c "import torch"`, what a command that
imports torch before parsing its arguments pays before it can print anything. Best of --iters
runs each; the ratios are against the interpreter alone and against importing torch.
"""

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMANDS = ("quantize", "convert", "ptq", "export", "check", "report", "make_tiny")


def best_of(argv: list[str], iters: int) -> float:
    env = {**os.environ, "PYTHONPATH": ROOT}
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        subprocess.run(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--iters", type=int, default=5)
    a = p.parse_args()
    python = best_of([sys.executable, "-c", "pass"], a.iters)
    torch_import = best_of([sys.executable, "-c", "import torch"], a.iters)
    print(f"python -c pass: {python:.3f} s; python -c 'import torch': {torch_import:.3f} s")
    print(f"{'command --help':<26} {'s':>7} {'x python':>9} {'x import torch':>15}")
    for name in COMMANDS:
        t = best_of([sys.executable, "-m", f"eprt.commands.{name}", "--help"], a.iters)
        print(f"eprt-{name.replace('_', '-'):<21} {t:7.3f} {t / python:9.2f} {t / torch_import:15.2f}")


if __name__ == "__main__":
    main()
