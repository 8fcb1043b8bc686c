"""World 1 against world 2 on this machine's device: the same calibration exports the same bytes.

    python bench/gpu_layouts.py --json OUT.json [--algorithm gptq]

A tiny DeepSeek-V3 (MLA, dense and MoE layers, block FP8 as released) is calibrated by tools/ptq.py
at world 1 and at world 2 (ep 2), then both are exported, and every file of the two exports is
compared byte for byte. On a machine of one GPU the two ranks share it over gloo
(EPRT_RANKS_SHARE_GPU=1), so every multi-rank path (the token exchange, the reductions, the fail
together guards, the work directory's barriers) runs on CUDA tensors; without CUDA they are two CPU
processes. With --algorithm gptq, GPTQ's int64 Hessians and fp64 solve run on the device too.
"""

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402


def digests(root: str) -> dict[str, str]:
    """Every file under `root` by its path there: its SHA-256."""
    out = {}
    for here, _, files in os.walk(root):
        for f in files:
            path = os.path.join(here, f)
            with open(path, "rb") as fh:
                out[os.path.relpath(path, root)] = hashlib.sha256(fh.read()).hexdigest()
    return out


def calibrate_and_export(ck: str, out: str, world: int, algorithm: str) -> float:
    """tools/ptq.py on `world` local ranks, then the export; returns the calibration's seconds."""
    env = {**os.environ, "EPRT_RANKS_SHARE_GPU": "1", "OMP_NUM_THREADS": "1"}
    start = time.perf_counter()
    cmd = [sys.executable, os.path.join(REPO, "tools", "ptq.py"), "--nproc-per-node", str(world), ck]
    cmd += ["--recipe", "nvfp4", "--kv-cache", "fp8", "--algorithm", algorithm, "--ep", str(world)]
    cmd += ["--calib-size", "8", "--seq-len", "64", "--eval-size", "2", "--out", out + ".q"]
    subprocess.run(cmd, check=True, env=env)
    took = time.perf_counter() - start
    export_hf(out + ".q", out, progress=False)
    return took


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True)
    p.add_argument("--algorithm", default="max", choices=["max", "gptq"])
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        hf = make_tiny("deepseek_v3", os.path.join(d, "hf"), source_format="fp8-block")
        ck = convert_hf(hf, os.path.join(d, "ck"), progress=False)
        seconds = {w: calibrate_and_export(ck, os.path.join(d, f"world{w}"), w, a.algorithm) for w in (1, 2)}
        one, two = digests(os.path.join(d, "world1")), digests(os.path.join(d, "world2"))
    differ = sorted(f for f in one.keys() & two.keys() if one[f] != two[f])
    figures = {
        "algorithm": a.algorithm,
        "files": len(one),
        "same_file_set": one.keys() == two.keys(),
        "only_in_one": sorted(one.keys() - two.keys()),
        "only_in_two": sorted(two.keys() - one.keys()),
        "differ": differ,
        "calibration_s": {f"world {w}": round(s, 2) for w, s in seconds.items()},
    }
    with open(a.json, "w") as f:
        json.dump(figures, f, indent=2)
    same = figures["same_file_set"] and not differ
    print(
        f"world 1 against world 2, {a.algorithm}: {len(one)} files, "
        + ("the same bytes" if same else f"differ: {differ}")
    )
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
