"""The CPU's bf16 matmul against the same matmul widened to fp32, side by side (one thread).

    python bench/cpu_matmul.py [--rows 128 256] [--shapes 1152x1024 1024x576 4096x1024]

On a CPU without bf16 dot-product instructions (AVX512-BF16, AMX) the BLAS emulates the bf16
GEMM; eprt then multiplies bf16 operands in fp32 and rounds the result once to bf16
(eprt.kernels.backend.matmul_dtype). Printed per shape: the bf16 GEMM's time, the widened one's
(the operands' conversion included, as eprt pays it), their ratio, and the largest difference
between the two results in bf16 ulps (the accumulation order may differ; both sum in fp32).
"""

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import timed  # noqa: E402
from eprt.kernels.backend import matmul_dtype  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[128, 256])
    p.add_argument("--shapes", nargs="+", default=["1152x1024", "1024x576", "4096x1024"], help="weight shapes NxK")
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args()
    torch.set_num_threads(1)  # as a rank under torchrun computes
    cpu = torch.device("cpu")
    print(f"bf16 matmuls compute in {matmul_dtype(torch.bfloat16, cpu)} on this CPU; one thread, best of {args.iters}")
    print(f"{'rows':>6}{'N x K':>12}{'bf16 ms':>10}{'fp32 ms':>10}{'bf16/fp32':>11}{'max ulp':>9}")
    g = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        N, K = map(int, shape.split("x"))
        w = torch.randn(N, K, generator=g).bfloat16()
        for M in args.rows:
            x = torch.randn(M, K, generator=g).bfloat16()
            native = timed(lambda: F.linear(x, w), cpu, args.iters)
            wide = timed(lambda: F.linear(x.float(), w.float()).bfloat16(), cpu, args.iters)
            a, b = F.linear(x, w), F.linear(x.float(), w.float()).bfloat16()
            ulp = (ordered(a) - ordered(b)).abs().max().item()
            print(f"{M:>6}{shape:>12}{native * 1e3:>10.2f}{wide * 1e3:>10.2f}{native / wide:>10.2f}x{ulp:>9}")


def ordered(t: torch.Tensor) -> torch.Tensor:
    """bf16 bit patterns as integers in the order of their values, so that a difference counts ulps
    (across zero too)."""
    i = t.view(torch.int16).int()
    return torch.where(i < 0, -(i & 0x7FFF), i)


if __name__ == "__main__":
    main()
