"""Calibration on one GPU at ep 1: tokens/s, peak GPU memory against the memory plan, and the time
against the dry run's estimate, on a random Qwen3-MoE of about 2 B parameters.

    python bench/gpu_ptq.py --json OUT.json           # CUDA: ~1.9 B parameters in bf16, NVFP4 + FP8 KV
    python bench/gpu_ptq.py --tiny --json OUT.json    # anywhere: a tiny model (the CPU, peak RSS, without CUDA)
    python bench/gpu_ptq.py --make DIR [--tiny]       # only make the model's checkpoint in DIR (on the CPU)
    python bench/gpu_ptq.py --checkpoint DIR ...      # calibrate the one --make made

The model is make_tiny's Qwen3-MoE with Qwen3-30B-A3B's layer sizes (hidden 2048, 128 experts
top-8, moe_intermediate 768, every layer MoE) and few layers, converted to an eprt checkpoint and
calibrated in this process (a world of one) through run_ptq. The kernels are compiled on a small
problem first, so that the figure is the calibration's own: calibration tokens over run_ptq's
calibration time (the forwards and the reduction; load and save excluded). Peak memory is the
allocator's high-water mark from just before loading, beside the weight bytes it holds. Before the
run, the run's own memory plan (eprt.quant.run.setup.plan_run) and the dry run's time estimate
(eprt.quant.run.estimate, its probe included) are made for the same arguments; the figures set them
beside the measured peak (allocated, and reserved by the caching allocator: its margin) and time.
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
from eprt.loading.resolved import ResolvedCheckpoint  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.algorithms.program import program_of  # noqa: E402
from eprt.quant.run.estimate import estimate_time  # noqa: E402
from eprt.quant.run.memory_plan import MemoryPlan  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.quant.run.setup import (  # noqa: E402
    plan_recipe,
    plan_run,
    run_dtype,  # noqa: E402
    run_shape,
)
from eprt.storage.checkpoint import Checkpoint  # noqa: E402

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


def plan_and_estimate(state: ParallelState, a: PTQArgs) -> tuple[MemoryPlan, float]:
    """The run's memory plan on its device (its baseline the memory in use now) and the dry run's
    estimate of its calibration time, for arguments `a`."""
    with Checkpoint(a.ckpt) as ck:
        rc = ResolvedCheckpoint.of(ck, run_dtype(a.dtype))
        program = program_of(*plan_recipe(rc, a.recipe, a.kv_cache, a.algorithm))
        plan, _ = plan_run(state, rc, a, program)
        shape = program.shape(run_shape(a, state, ck.config))
        with torch.inference_mode():
            estimate = estimate_time(state, rc, program, shape, expert_stack=plan.expert_stack)
    return plan, estimate.seconds


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", help="where to write the figures")
    p.add_argument("--tiny", action="store_true", help="a tiny model, on the CPU unless CUDA is there")
    p.add_argument("--recipe", default="nvfp4")
    p.add_argument("--make", metavar="DIR", help="only make the model's checkpoint in DIR, then exit")
    p.add_argument("--checkpoint", metavar="DIR", help="calibrate the checkpoint --make made in DIR")
    a = p.parse_args()
    size = SimpleNamespace(**(TINY if a.tiny else FULL))
    if a.make:
        start = time.perf_counter()
        make_checkpoint(size, a.make)
        print(f"made {a.make} in {time.perf_counter() - start:.1f} s", flush=True)
        return
    if not a.json:
        sys.exit("bench/gpu_ptq.py: --json is required (or --make DIR)")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not a.tiny and device.type != "cuda":
        sys.exit("bench/gpu_ptq.py: the 2 B model needs a CUDA GPU; use --tiny here")
    with tempfile.TemporaryDirectory() as d:
        start = time.perf_counter()
        made = a.checkpoint or d
        ck = os.path.join(made, "ck") if a.checkpoint else make_checkpoint(size, d)
        params = parameters(os.path.join(made, "hf"))
        made_s = time.perf_counter() - start
        print(
            f"{'found' if a.checkpoint else 'made and converted'} a {params / 1e6:.1f} M-parameter Qwen3-MoE in "
            f"{made_s:.1f} s",
            flush=True,
        )
        warm_up(size.hidden, size.width, size.experts, size.topk, device)
        state = ParallelState.single(device)
        args = PTQArgs(
            ck,
            a.recipe,
            os.path.join(d, "q"),
            kv_cache="fp8",
            calib_size=size.calib_size,
            seq_len=size.seq_len,
            batch_size=size.batch_size,
            dtype=size.dtype,
            progress=False,
        )
        plan, estimated = plan_and_estimate(state, args)
        planned = plan.allocated
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        else:
            reset_peak()
            base = rss()
        start = time.perf_counter()
        r = run_ptq(state, args)
        total_s = time.perf_counter() - start
        if device.type == "cuda":
            allocated, reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            free, total = torch.cuda.mem_get_info()
            outside = (total - free) - torch.cuda.memory_reserved()  # the CUDA context, cuBLAS's and NCCL's own
        else:
            allocated = reserved = peak_rss()
            outside = 0
        peak = allocated - base
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
        "planned_peak_bytes": planned,
        "planned_reserved_bytes": planned + int(planned * plan.reserve),
        "planned_outside_allocator_bytes": plan.fixed,
        "planned_device_peak_bytes": plan.peak,
        "measured_peak_allocated_bytes": allocated,
        "measured_peak_reserved_bytes": reserved,
        "allocator_margin_bytes": reserved - allocated,
        "outside_allocator_bytes": outside,
        "allocated_vs_plan": allocated / planned,
        "reserved_vs_plan": reserved / planned,
        "estimated_calibration_s": estimated,
        "calibration_vs_estimate": r["calibration_s"] / estimated,
        "weight_bytes": params * 2,
        "peak_vs_weights": peak / (params * 2),
    }
    print(
        f"{a.recipe} + FP8 KV, {params / 1e6:.1f} M parameters, ep 1 on {figures['device']}: "
        f"{figures['tokens_per_s']:.0f} calibration tokens/s ({r['tokens']} tokens in {r['calibration_s']:.2f} s), "
        f"peak {peak / 2**30:.2f} GiB = {figures['peak_vs_weights']:.2f}x the bf16 weights; measured peak "
        f"{allocated / 2**30:.2f} GiB allocated, {reserved / 2**30:.2f} GiB reserved against the plan's "
        f"{planned / 2**30:.2f} GiB; calibration {r['calibration_s']:.1f} s against the estimate's {estimated:.1f} s"
    )
    with open(a.json, "w") as f:
        json.dump(figures, f, indent=2)


if __name__ == "__main__":
    main()
