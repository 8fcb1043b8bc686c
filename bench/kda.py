"""KDA throughput: the chunked torch implementation beside the token-by-token recurrence, in one run.

    python bench/kda.py                                  # CPU, Kimi-Linear's shape (32 heads of 128)
    python bench/kda.py --heads 96 --tokens 512 1024     # Kimi-K3's 96 heads
    python bench/kda.py --device cuda                    # adds flash-linear-attention's chunk_kda when installed

One KDA layer's core (after the projections) on random inputs of a trained model's form: q and k
L2-normalized, a per-channel log-decay bounded by --decay per token, beta in (0, 1). Reported per
sequence length: tokens/s of each implementation (best of --iters after a warm-up) and the
largest difference of its output from the recurrence's.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.timing import timed  # noqa: E402
from eprt.models.kda import chunk_size, fla_chunk_kda, kda, kda_chunked, kda_recurrent, l2norm  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, nargs="+", default=[256, 1024])
    p.add_argument("--decay", type=float, default=1.0, help="largest per-token log-decay magnitude")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    g = torch.Generator(device=device).manual_seed(0)
    print(
        f"device {device}, threads {torch.get_num_threads()}, batch {a.batch}, {a.heads} heads of {a.head_dim}, "
        f"decay up to {a.decay}/token"
    )
    print(
        f"{'tokens':>7} {'chunk':>5} {'recurrent tok/s':>16} {'chunked tok/s':>14} {'speed-up':>8} {'max diff':>9}"
        + (f" {'fla tok/s':>10} {'diff':>9}" if device.type == "cuda" and fla_chunk_kda() else "")
    )
    for T in a.tokens:
        shape = (a.batch, T, a.heads, a.head_dim)
        q_raw, k_raw = torch.randn(shape, generator=g, device=device), torch.randn(shape, generator=g, device=device)
        q, k = l2norm(q_raw) * a.head_dim**-0.5, l2norm(k_raw)
        v = torch.randn(shape, generator=g, device=device)
        decay = -a.decay * torch.rand(shape, generator=g, device=device)
        beta = torch.rand(shape[:3], generator=g, device=device)
        want = kda_recurrent(q, k, v, decay, beta)
        tokens = a.batch * T
        rec = timed(lambda: kda_recurrent(q, k, v, decay, beta), device, 1)
        chunked = timed(lambda: kda_chunked(q, k, v, decay, beta), device, a.iters)
        diff = (kda_chunked(q, k, v, decay, beta) - want).abs().max().item()
        line = (
            f"{T:>7} {chunk_size(decay):>5} {tokens / rec:>16,.0f} {tokens / chunked:>14,.0f} "
            f"{rec / chunked:>7.1f}x {diff:>9.1e}"
        )
        if device.type == "cuda" and fla_chunk_kda():
            fla = timed(lambda: kda(q_raw, k_raw, v, decay, beta), device, a.iters)
            line += f" {tokens / fla:>10,.0f} {(kda(q_raw, k_raw, v, decay, beta) - want).abs().max().item():>9.1e}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
