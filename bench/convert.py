"""Conversion throughput against a plain fsynced copy of the same files, and peak memory against the largest layer;
conversion by reference (`--reference`: no weight copied) against reading the source's headers.

    python bench/convert.py [--experts 64] [--hidden 1024] [--width 512] [--layers 4] [--repeat 2]

The copy and the conversion read the same source files and write the same number of bytes to the
same disk, each file fsynced; each runs in its own process, so its peak RSS is its own. The
conversion by reference writes its manifest (and the source's small files) only; its time is
set beside opening the source (`eprt.hf.source.HFSource`: every header read and checked).
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Each child times its own work, after its imports, and prints the seconds.
COPY = """
import os, shutil, sys, time
src, dst = sys.argv[1], sys.argv[2]
t = time.perf_counter()
os.makedirs(dst)
for f in sorted(os.listdir(src)):
    shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    with open(os.path.join(dst, f), "rb") as fh:
        os.fsync(fh.fileno())
print(time.perf_counter() - t)
"""
CONVERT = """
import sys, time
from eprt.hf.convert import convert_hf
t = time.perf_counter()
convert_hf(sys.argv[1], sys.argv[2], progress=False)
print(time.perf_counter() - t)
"""
MAKE = """
import json, sys
from eprt.testing.tiny import make_tiny
make_tiny("qwen3_moe", sys.argv[1], shards=4, **json.loads(sys.argv[2]))
"""
REFERENCE = CONVERT.replace("progress=False)", "progress=False, reference=True)")
HEADERS = """
import sys, time
from eprt.hf.source import HFSource
t = time.perf_counter()
HFSource(sys.argv[1]).close()
print(time.perf_counter() - t)
"""
IMPORTS = "import time; from eprt.hf.convert import convert_hf; print(0.0)"


def run(code: str, *args: str) -> tuple[float, int]:
    """(seconds of work, peak RSS in bytes) of one child process."""
    p = subprocess.Popen([sys.executable, "-c", code, *args], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    out = p.stdout.read()
    _, status, usage = os.wait4(p.pid, 0)
    if status:
        raise SystemExit(f"child failed: {code[:40]}...")
    return float(out.split()[-1]), usage.ru_maxrss * 1024


def tree_bytes(root: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    a = ap.parse_args()
    work = tempfile.mkdtemp(dir=a.dir)
    try:
        # Made in a child: this process stays small, so that the children's peak RSS is their own
        # (a forked child starts with its parent's high-water mark).
        src = os.path.join(work, "hf")
        overrides = dict(
            hidden_size=a.hidden,
            num_experts=a.experts,
            moe_intermediate_size=a.width,
            num_hidden_layers=a.layers,
            mlp_only_layers=[],
            intermediate_size=4 * a.width,
            head_dim=64,
            num_attention_heads=a.hidden // 64,
            num_key_value_heads=4,
        )
        subprocess.run([sys.executable, "-c", MAKE, src, json.dumps(overrides)], cwd=ROOT, check=True)
        size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
        _, base_rss = run(IMPORTS)
        best = {"copy": float("inf"), "convert": float("inf"), "reference": float("inf"), "headers": float("inf")}
        peak = 0
        for _ in range(a.repeat):
            kinds = (("copy", COPY), ("convert", CONVERT), ("reference", REFERENCE), ("headers", HEADERS))
            for kind, code in kinds:
                out = os.path.join(work, kind)
                shutil.rmtree(out, ignore_errors=True)
                secs, rss = run(code, src, out)
                best[kind] = min(best[kind], secs)
                if kind == "convert":
                    peak = max(peak, rss)
        ck = os.path.join(work, "convert")
        largest = max(os.path.getsize(os.path.join(ck, f)) for f in os.listdir(ck) if f.startswith("layer-"))
        mb = 1e6
        report = {
            "source_MB": round(size / mb, 1),
            "copy_MB_per_s": round(size / best["copy"] / mb, 1),
            "convert_MB_per_s": round(size / best["convert"] / mb, 1),
            "throughput_ratio_convert_over_copy": round(best["copy"] / best["convert"], 3),
            "largest_layer_MB": round(largest / mb, 1),
            "import_rss_MB": round(base_rss / mb, 1),
            "convert_peak_rss_MB": round(peak / mb, 1),
            "convert_peak_above_imports_MB": round((peak - base_rss) / mb, 1),
            "aim_peak_MB (2 x largest layer + 300)": round((2 * largest + 300e6) / mb, 1),
            "reference_s": round(best["reference"], 4),
            "headers_s": round(best["headers"], 4),
            "ratio_reference_over_headers": round(best["reference"] / best["headers"], 2),
            "ratio_reference_over_convert": round(best["reference"] / best["convert"], 4),
            "reference_written_MB": round(tree_bytes(os.path.join(work, "reference")) / mb, 3),
        }
        print(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
