"""Calibration on one GPU at ep 1: tokens/s and peak GPU memory on a random Qwen3-MoE of about 2 B parameters.

    python bench/gpu_ptq.py --json OUT.json           # CUDA: ~1.9 B parameters in bf16, NVFP4 + FP8 KV
    python bench/gpu_ptq.py --tiny --json OUT.json    # anywhere: a tiny model (the CPU, peak RSS, without CUDA)

The model is make_tiny's Qwen3-MoE with Qwen3-30B-A3B's layer sizes (hidden 2048, 128 experts
top-8, moe_intermediate 768, every layer MoE) and few layers, converted to an eprt checkpoint and
calibrated in this process (a world of one) through run_ptq. The kernels are compiled on a small
problem first, so that the figure is the calibration's own: calibration tokens over run_ptq's
calibration time (the forwards and the reduction; load and save excluded). Peak memory is the
allocator's high-water mark from just before loading, beside the weight bytes it holds.
"""

import argparse
import json
import math
import os
import sys
import tempfile
import time
from types import SimpleNamespace

import torch
from safetensors import safe_open

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ep import make_checkpoint, peak_rss, reset_peak, rss  # noqa: E402
from eprt.kernels import combine, grouped_mm, permute  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402

# make_checkpoint's sizes. vocab: at most the tiny tokenizer's 512.
FULL = dict(
    layers=3,
    hidden=2048,
    experts=128,
    topk=8,
    width=768,
    vocab=512,
    dtype="bf16",
    calib_size=64,
    seq_len=1024,
    batch_size=8,
)
TINY = dict(
    layers=2, hidden=128, experts=8, topk=2, width=64, vocab=512, dtype="bf16", calib_size=8, seq_len=64, batch_size=4
)


def parameters(hf_dir: str) -> int:
    """Parameters of the checkpoint, read from the safetensors headers."""
    total = 0
    for f in os.listdir(hf_dir):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(hf_dir, f), "pt") as fh:
                for name in fh.keys():
                    total += math.prod(fh.get_slice(name).get_shape())
    return total


def warm_up(hidden: int, width: int, experts: int, topk: int, device: torch.device) -> None:
    """Compile the kernels the MoE layers call (Triton compiles on first use)."""
    x = torch.randn(32, hidden, device=device, dtype=torch.bfloat16)
    x_sorted, counts, order = permute(x, torch.randint(0, experts, (32, topk), device=device), experts)
    offsets = counts.cumsum(0).to(torch.int32)
    grouped_mm(x_sorted, torch.randn(experts, 2 * width, hidden, device=device, dtype=torch.bfloat16), offsets)
    y = grouped_mm(
        x_sorted[:, :width].contiguous(),
        torch.randn(experts, hidden, width, device=device, dtype=torch.bfloat16),
        offsets,
    )
    combine(y, order, torch.rand(32, topk, device=device))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="where to write the figures")
    p.add_argument("--tiny", action="store_true", help="a tiny model, on the CPU unless CUDA is there")
    p.add_argument("--recipe", default="nvfp4")
    a = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not a.tiny and device.type != "cuda":
        sys.exit("bench/gpu_ptq.py: the 2 B model needs a CUDA GPU; use --tiny here")
    size = SimpleNamespace(**(TINY if a.tiny else FULL))
    with tempfile.TemporaryDirectory() as d:
        start = time.perf_counter()
        ck = make_checkpoint(size, d)
        params = parameters(os.path.join(d, "hf"))
        made_s = time.perf_counter() - start
        print(f"made and converted a {params / 1e6:.1f} M-parameter Qwen3-MoE in {made_s:.1f} s", flush=True)
        warm_up(size.hidden, size.width, size.experts, size.topk, device)
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            reset_peak()
            base = rss()
        start = time.perf_counter()
        r = run_ptq(
            ParallelState.single(device),
            PTQArgs(
                ck,
                a.recipe,
                os.path.join(d, "q"),
                kv_cache="fp8",
                calib_size=size.calib_size,
                seq_len=size.seq_len,
                batch_size=size.batch_size,
                dtype=size.dtype,
                progress=False,
            ),
        )
        total_s = time.perf_counter() - start
        peak = (torch.cuda.max_memory_allocated() if device.type == "cuda" else peak_rss()) - base
    figures = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "model": {
            "family": "qwen3_moe",
            "parameters": params,
            "layers": size.layers,
            "hidden": size.hidden,
            "experts": size.experts,
            "topk": size.topk,
            "moe_intermediate": size.width,
            "dtype": size.dtype,
        },
        "recipe": a.recipe,
        "kv_cache": "fp8",
        "ep": 1,
        "calibration_tokens": r["tokens"],
        "batch_size": size.batch_size,
        "seq_len": size.seq_len,
        "calibration_s": r["calibration_s"],
        "tokens_per_s": r["tokens"] / r["calibration_s"],
        "run_ptq_s": total_s,
        "make_and_convert_s": made_s,
        "peak_memory_bytes": peak,
        "peak_memory_kind": "cuda max_memory_allocated" if device.type == "cuda" else "RSS",
        "weight_bytes": params * 2,
        "peak_vs_weights": peak / (params * 2),
    }
    print(
        f"{a.recipe} + FP8 KV, {params / 1e6:.1f} M parameters, ep 1 on {figures['device']}: "
        f"{figures['tokens_per_s']:.0f} calibration tokens/s ({r['tokens']} tokens in {r['calibration_s']:.2f} s), "
        f"peak {peak / 2**30:.2f} GiB = {figures['peak_vs_weights']:.2f}x the bf16 weights"
    )
    with open(a.json, "w") as f:
        json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
