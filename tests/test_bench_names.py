"""A bench script runs with bench/ first on sys.path, so a script named like an installed module
stands in for it in every import of that name, the libraries' own included (a bench/kernels.py once
broke transformers' `from kernels import ...` when transformers began to use that package)."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def test_no_bench_script_is_named_like_an_importable_module():
    names = sorted(p.stem for p in BENCH.glob("*.py"))
    assert names
    here = {"", ".", str(BENCH)}
    saved = sys.path[:]
    try:
        sys.path[:] = [p for p in sys.path if p not in here]
        shadowing = [n for n in names if n in sys.stdlib_module_names or importlib.util.find_spec(n) is not None]
    finally:
        sys.path[:] = saved
    assert shadowing == []
