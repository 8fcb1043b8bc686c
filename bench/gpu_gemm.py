"""Grouped GEMM at real MoE expert shapes: TFLOP/s beside a dense matmul of equal FLOPs and torch._grouped_mm.

    python bench/gpu_gemm.py --json OUT.json            # CUDA: DeepSeek-V3 and Qwen3-30B-A3B, 4096 and 16384 tokens
    python bench/gpu_gemm.py --tiny --json OUT.json     # anywhere: one tiny shape (the CPU fallback on a CPU)

Each token goes to top-k of E experts drawn at random (each expert gets about T*k/E rows, as
a trained router's load-balanced layers give). Both projections of an expert are timed: gate/up
(x [T*k, hidden] against w13 [E, 2*inter, hidden]) and down (against w2 [E, hidden, inter]).
The dense yardstick multiplies the same [T*k, K] rows by one [N, K] weight (cuBLAS on a GPU):
the same FLOPs with no grouping, the speed a grouped GEMM can at best approach.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import timed  # noqa: E402
from eprt.kernels import grouped_mm, permute  # noqa: E402
from eprt.kernels.backend import use_triton  # noqa: E402

# name: (hidden, moe_intermediate, experts, top-k), from each model's config.json.
SHAPES = {"deepseek_v3": (7168, 2048, 256, 8), "qwen3_30b_a3b": (2048, 768, 128, 8)}
TOKENS = (4096, 16384)
TINY = {"tiny": (256, 128, 8, 2)}
TINY_TOKENS = (64,)


def bench_shape(
    name: str, hidden: int, inter: int, experts: int, topk: int, tokens: int, device: torch.device, iters: int
) -> list[dict]:
    g = torch.Generator(device=device).manual_seed(0)
    x_TD = torch.randn(tokens, hidden, device=device, dtype=torch.bfloat16, generator=g)
    expert_ids_TK = torch.randn(tokens, experts, device=device, generator=g).topk(topk, dim=1).indices
    x_sorted, tokens_per_expert, _ = permute(x_TD, expert_ids_TK, experts)
    offsets = tokens_per_expert.cumsum(0).to(torch.int32)
    rows = []
    for proj, (N, K) in {"gate_up": (2 * inter, hidden), "down": (hidden, inter)}.items():
        w = torch.randn(experts, N, K, device=device, dtype=torch.bfloat16, generator=g) / K**0.5
        x = (
            x_sorted
            if K == hidden
            else torch.randn(x_sorted.shape[0], K, device=device, dtype=torch.bfloat16, generator=g)
        )
        M = x.shape[0]
        flops = 2 * M * N * K
        row = {
            "shape": name,
            "projection": proj,
            "tokens": tokens,
            "M": M,
            "N": N,
            "K": K,
            "experts": experts,
            "impl": "triton" if use_triton(x) else "torch fallback",
        }
        for key, fn in (
            ("grouped_mm", lambda x=x, w=w: grouped_mm(x, w, offsets)),
            ("torch_grouped_mm", lambda x=x, w=w: torch._grouped_mm(x, w.transpose(1, 2), offsets)),
            ("dense_mm", lambda x=x, w=w: x @ w[0].T),
        ):
            try:
                seconds = timed(fn, device, iters)
            except (RuntimeError, NotImplementedError) as err:  # _grouped_mm refuses some dtypes and devices
                row[f"{key}_error"] = str(err).splitlines()[0][:120]
                continue
            row[f"{key}_ms"] = seconds * 1e3
            row[f"{key}_tflops"] = flops / seconds / 1e12
        for base in ("dense_mm", "torch_grouped_mm"):
            if "grouped_mm_ms" in row and f"{base}_ms" in row:
                row[f"vs_{base}"] = row[f"{base}_ms"] / row["grouped_mm_ms"]  # > 1: ours is faster
        rows.append(row)
        del w, x
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def table(rows: list[dict]) -> str:
    def f(row, key, fmt):
        return format(row[key], fmt) if key in row else "-"

    lines = [
        f"{'shape':14} {'proj':8} {'tokens':>6} {'M':>7} {'N':>5} {'K':>5}  {'ours TF/s':>9} "
        f"{'_grouped_mm':>11} {'dense':>7}  {'vs _gmm':>7} {'vs dense':>8}"
    ]
    for r in rows:
        lines.append(
            f"{r['shape']:14} {r['projection']:8} {r['tokens']:>6} {r['M']:>7} {r['N']:>5} {r['K']:>5}  "
            f"{f(r, 'grouped_mm_tflops', '9.1f')} {f(r, 'torch_grouped_mm_tflops', '11.1f')} "
            f"{f(r, 'dense_mm_tflops', '7.1f')}  {f(r, 'vs_torch_grouped_mm', '7.2f')} "
            f"{f(r, 'vs_dense_mm', '8.2f')}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--json", required=True, help="where to write the figures")
    p.add_argument("--tiny", action="store_true", help="one tiny shape, on the CPU unless CUDA is there")
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not args.tiny and device.type != "cuda":
        sys.exit("bench/gpu_gemm.py: the model shapes need a CUDA GPU; use --tiny here")
    shapes, token_counts = (TINY, TINY_TOKENS) if args.tiny else (SHAPES, TOKENS)
    rows = []
    for name, (hidden, inter, experts, topk) in shapes.items():
        for tokens in token_counts:
            rows += bench_shape(name, hidden, inter, experts, topk, tokens, device, args.iters)
            print(
                f"{name}, {tokens} tokens: "
                + ", ".join(
                    f"{r['projection']} {r.get('grouped_mm_tflops', float('nan')):.1f} TFLOP/s" for r in rows[-2:]
                ),
                flush=True,
            )
    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, bf16, best of {args.iters}")
    print(table(rows))
    with open(args.json, "w") as f:
        json.dump({"device": str(device), "iters": args.iters, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
