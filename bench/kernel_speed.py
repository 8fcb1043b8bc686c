"""Kernel throughput, each measured beside its yardstick in the same run.

    python bench/kernel_speed.py                       # CPU: the torch fallbacks, well under a minute
    python bench/kernel_speed.py --device cuda --experts 128 --tokens 16384 --topk 8 --hidden 4096 --inter 1536

grouped_mm (the MoE gate/up projection, x [T*topk, hidden] against w13 [E, 2*inter, hidden])
is set against torch._grouped_mm on the same problem and against one dense matmul of equal
FLOPs; permute and combine against a plain copy of as many bytes as they move.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import timed  # noqa: E402
from eprt.kernels import combine, grouped_mm, permute  # noqa: E402
from eprt.kernels.backend import use_triton  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--inter", type=int, default=512, help="expert intermediate size; w13 has 2*inter rows")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    E, T, K, D, I = args.experts, args.tokens, args.topk, args.hidden, args.inter
    torch.manual_seed(0)

    x_TD = torch.randn(T, D, device=device, dtype=dtype)
    expert_ids_TK = torch.randn(T, E, device=device).topk(K, dim=1).indices
    weights_TK = torch.rand(T, K, device=device)
    w13 = torch.randn(E, 2 * I, D, device=device, dtype=dtype) / D**0.5
    x_sorted, tokens_per_expert, order = permute(x_TD, expert_ids_TK, E)
    offsets = tokens_per_expert.cumsum(0).to(torch.int32)
    M = x_sorted.shape[0]
    impl = "triton" if use_triton(x_TD) else "torch fallback"

    rows = []
    flops = 2 * M * 2 * I * D

    def gemm_row(name, fn):
        try:
            t = timed(fn, device, args.iters)
        except (RuntimeError, NotImplementedError) as err:  # _grouped_mm refuses some dtypes and devices
            rows.append((name, f"M={M} N={2 * I} K={D}", None, f"unsupported: {str(err).splitlines()[0][:50]}"))
            return None
        rows.append((name, f"M={M} N={2 * I} K={D}", t, f"{flops / t / 1e12:.3f} TFLOP/s"))
        return t

    t_ours = gemm_row(f"grouped_mm ({impl})", lambda: grouped_mm(x_sorted, w13, offsets))
    t_torch = gemm_row("torch._grouped_mm", lambda: torch._grouped_mm(x_sorted, w13.transpose(1, 2), offsets))
    dense_w = w13[0]
    t_dense = gemm_row("dense mm, equal FLOPs", lambda: x_sorted @ dense_w.T)

    es = x_TD.element_size()
    permute_bytes = 2 * M * D * es  # each of the T*K rows read once and written once
    combine_bytes = M * D * es + T * D * 4  # y read, fp32 out written
    copy_src = torch.empty(permute_bytes // 2, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    y_sorted = x_sorted * 2

    def bw_row(name, shape, fn, nbytes):
        t = timed(fn, device, args.iters)
        rows.append((name, shape, t, f"{nbytes / t / 1e9:.2f} GB/s"))
        return t

    t_perm = bw_row(f"permute ({impl})", f"T={T} K={K} D={D}", lambda: permute(x_TD, expert_ids_TK, E), permute_bytes)
    t_comb = bw_row(
        f"combine ({impl})", f"T={T} K={K} D={D}", lambda: combine(y_sorted, order, weights_TK), combine_bytes
    )
    t_copy = bw_row(
        "copy, permute's bytes", f"{permute_bytes / 2**20:.1f} MiB", lambda: copy_dst.copy_(copy_src), permute_bytes
    )

    print(f"device={device} dtype={args.dtype} threads={torch.get_num_threads()} E={E} T={T} topk={K}")
    print(f"{'kernel':32} {'shape':24} {'ms':>9}  rate")
    for name, shape, t, rate in rows:
        print(f"{name:32} {shape:24} {t * 1e3 if t else float('nan'):9.3f}  {rate}")
    print("ratios (ours / yardstick, higher is better):")
    if t_ours and t_torch:
        print(f"  grouped_mm vs torch._grouped_mm   {t_torch / t_ours:.2f}")
    if t_ours and t_dense:
        print(f"  grouped_mm vs dense mm            {t_dense / t_ours:.2f}")
    print(f"  permute vs copy (GB/s)            {t_copy / t_perm:.2f}")
    print(f"  combine vs copy (GB/s)            {(combine_bytes / t_comb) / (permute_bytes / t_copy):.2f}")


if __name__ == "__main__":
    main()
