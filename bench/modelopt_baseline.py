"""eprt against transformers + ModelOpt, side by side, on one random Qwen3-MoE (CPU).

    python bench/modelopt_baseline.py [--layers 8] [--experts 32] [--hidden 1024] [--calib-size 64] [--seq-len 256]
    pip install eprt[bench]          # nvidia-modelopt and transformers

The model (8 layers x 32 experts, hidden 1024: ~0.9 GB in bf16) is written once as a Hugging Face
checkpoint and converted for eprt. Both sides calibrate NVFP4 weights and an FP8 KV cache with
max calibration on the same 64 x 256 token ids, and export the ModelOpt HF layout. Every
measured step runs in a fresh process of its own:
- ptq wall: eprt's `tools/ptq.py` from process start to its output written, against ModelOpt's
  model load + `mtq.quantize` (from process start, the same clock);
- export wall: eprt's `export_hf` call (reading the calibrated checkpoint, quantizing, writing,
  syncing to disk and checking the output), against `export_hf_checkpoint` alone (from the
  calibrated model in memory, no sync): both after their process has started and imported its
  libraries; `tools/export_hf.py` whole (process start, imports) is shown beside it;
- peak RSS: the process's high-water mark (per rank under torchrun: the largest rank);
- eprt's calibration tokens/s at ep 1, 2, 4 (world = ep, one thread a rank), and at ep 1 with
  --calib-size 8x smaller, to show the rate does not fall as the data grows.
Printed as eprt / ModelOpt ratios beside the raw numbers; run it alone on the machine.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

MiB = 2**20

# Run as a child: the ModelOpt side, timed from its own start. Prints one JSON line.
MODELOPT_CHILD = r"""
import json, sys, time
start = time.perf_counter()
import torch
from transformers import AutoModelForCausalLM
import modelopt.torch.quantization as mtq
from modelopt.torch.export import export_hf_checkpoint

hf, ids_path, out = sys.argv[1:4]
torch.manual_seed(0)
model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
model.eval()
ids = torch.load(ids_path)
cfg = {"quant_cfg": [*mtq.NVFP4_DEFAULT_CFG["quant_cfg"], *mtq.FP8_KV_CFG["quant_cfg"]], "algorithm": "max"}

def forward_loop(m):
    with torch.no_grad():
        for row in ids:
            m(row[None])

mtq.quantize(model, cfg, forward_loop)
ptq_s = time.perf_counter() - start
t = time.perf_counter()
export_hf_checkpoint(model, export_dir=out)
export_s = time.perf_counter() - t
# VmHWM, not ru_maxrss: the latter keeps the high-water mark of the process that forked this one
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"ptq_s": ptq_s, "export_s": export_s, "peak": hwm * 1024}))
"""

# Run as a child: one command, timed from its start to its end, with the peak RSS of its
# largest descendant (a torchrun rank: ru_maxrss of the children, which this small process
# forks after its own exec, so no large parent's mark leaks in). Prints one JSON line, with the
# command's own last stdout line.
WALL_CHILD = r"""
import json, resource, subprocess, sys, time
start = time.perf_counter()
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
wall = time.perf_counter() - start
sys.stderr.write(r.stderr)
if r.returncode:
    sys.exit(r.returncode)
print(json.dumps({"wall_s": wall, "peak": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
                  "stderr": r.stderr, "stdout": (r.stdout.strip().splitlines() or [""])[-1]}))
"""

# Run as a child: eprt's export, the export call timed as ModelOpt's is (after the imports).
EPRT_EXPORT_CHILD = r"""
import json, sys, time
from eprt.hf.export import export_hf
start = time.perf_counter()
export_hf(sys.argv[1], sys.argv[2], progress=False)
print(json.dumps({"export_s": time.perf_counter() - start}))
"""


def child_json(args: list[str]) -> dict:
    r = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}
    )
    if r.returncode:
        raise SystemExit(f"{args[:3]} failed:\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def eprt_ptq(ck: str, ids: str, out: str, ep: int, calib_size: int, seq_len: int) -> dict:
    launch = (
        [] if ep == 1 else ["-m", "torch.distributed.run", "--nproc-per-node", str(ep), f"--master-port={free_port()}"]
    )
    cmd = [
        sys.executable,
        *launch,
        os.path.join(ROOT, "tools", "ptq.py"),
        ck,
        "--recipe",
        "nvfp4",
        "--kv-cache",
        "fp8",
        "--calib",
        ids,
        "--calib-size",
        str(calib_size),
        "--seq-len",
        str(seq_len),
        "--out",
        out,
    ]
    r = child_json(["-c", WALL_CHILD, *cmd])
    m = re.search(r"calibrated (\d+) tokens in ([\d.]+) s", r["stderr"])
    r["tokens_per_s"] = int(m.group(1)) / float(m.group(2))
    return r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--width", type=int, default=576, help="moe_intermediate_size")
    p.add_argument("--vocab", type=int, default=512, help="at most the tiny tokenizer's 512")
    p.add_argument("--calib-size", type=int, default=64)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--dtype", default="bf16")
    args = p.parse_args()

    import torch
    from safetensors.torch import save_file

    from bench.ep import make_checkpoint

    with tempfile.TemporaryDirectory() as d:
        ck = make_checkpoint(args, d)
        hf = os.path.join(d, "hf")
        size = sum(os.path.getsize(os.path.join(hf, f)) for f in os.listdir(hf) if f.endswith(".safetensors"))
        ids = torch.randint(0, args.vocab, (args.calib_size, args.seq_len), generator=torch.Generator().manual_seed(0))
        ids_pt, ids_st = os.path.join(d, "ids.pt"), os.path.join(d, "ids.safetensors")
        torch.save(ids, ids_pt)
        save_file({"input_ids": ids.contiguous()}, ids_st)

        mo = child_json(["-c", MODELOPT_CHILD, hf, ids_pt, os.path.join(d, "mo-export")])
        runs = {}
        for ep in args.ep:
            runs[ep] = eprt_ptq(ck, ids_st, os.path.join(d, f"q{ep}"), ep, args.calib_size, args.seq_len)
        small = eprt_ptq(ck, ids_st, os.path.join(d, "q-small"), 1, max(1, args.calib_size // 8), args.seq_len)
        export = child_json(
            [
                "-c",
                WALL_CHILD,
                sys.executable,
                "-c",
                EPRT_EXPORT_CHILD,
                os.path.join(d, f"q{args.ep[0]}"),
                os.path.join(d, "export"),
            ]
        )
        export_process = child_json(
            [
                "-c",
                WALL_CHILD,
                sys.executable,
                os.path.join(ROOT, "tools", "export_hf.py"),
                os.path.join(d, f"q{args.ep[0]}"),
                os.path.join(d, "export-process"),
            ]
        )

    tokens = args.calib_size * args.seq_len
    print(
        f"Qwen3-MoE {args.layers} layers x {args.experts} experts top-{args.topk}, hidden {args.hidden}, "
        f"{size / MiB:.0f} MiB {args.dtype}; NVFP4 + FP8 KV, max calibration on {args.calib_size} x {args.seq_len} "
        f"= {tokens} tokens; CPU, {os.cpu_count()} CPUs; each a fresh process"
    )
    print(f"{'':<34}{'eprt':>10}{'ModelOpt':>10}{'eprt/MO':>9}")

    def row(name, ours, theirs, unit, scale=1.0):
        print(f"{name:<34}{ours / scale:>9.1f}{unit}{theirs / scale:>9.1f}{unit}{ours / theirs:>8.2f}x")

    row("ptq wall (start -> written), ep 1", runs[1]["wall_s"], mo["ptq_s"], "s")
    row("export wall", json.loads(export["stdout"])["export_s"], mo["export_s"], "s")
    row("  eprt's whole export process", export_process["wall_s"], mo["export_s"], "s")
    row("peak RSS, ep 1", runs[1]["peak"], mo["peak"], "M", MiB)
    if 2 in runs:
        row("peak RSS per rank, ep 2", runs[2]["peak"], mo["peak"], "M", MiB)
    for ep, r in runs.items():
        vs = r["tokens_per_s"] / runs[1]["tokens_per_s"]
        print(f"eprt calibration tokens/s, ep {ep}: {r['tokens_per_s']:.0f} ({vs:.2f}x ep 1)")
    print(
        f"eprt calibration tokens/s, ep 1, --calib-size {max(1, args.calib_size // 8)}: "
        f"{small['tokens_per_s']:.0f} (at {args.calib_size}: {runs[1]['tokens_per_s'] / small['tokens_per_s']:.2f}x)"
    )


def free_port() -> int:
    from tests.multiproc import free_port as port

    return port()


if __name__ == "__main__":
    main()
