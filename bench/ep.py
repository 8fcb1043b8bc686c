"""Expert parallelism on this machine: throughput and each rank's peak memory at ep 1, 2 and 4.

    python bench/ep.py [--layers 4] [--hidden 512] [--experts 32] [--ep 1 2 4] [--batch 8] [--seq 128]

One random Qwen3-MoE (make_tiny with these sizes, every layer MoE, so that the routed experts
hold most of the bytes) runs the same global batch in worlds of ep CPU processes on gloo
(world = ep, one thread each); each rank runs every world-th sequence. Reported per ep:
- tokens/s: global tokens over the slowest rank's forward (best of --iters, after a warm-up);
- each rank's peak memory: its RSS high-water mark (reset once torch is loaded) minus its RSS
  before loading, beside the single process's, and beside dense + experts/ep (the weight bytes
  load_model holds, from the manifest) + activations (the forward's own high-water mark above
  the RSS after loading). The aim is a peak within 1.2x of that sum.
"""

import argparse
import os
import resource
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eprt  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.loading.loader import weight_bytes  # noqa: E402
from eprt.loading.resolved import ResolvedCheckpoint  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.multiproc import free_port, run_world  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
MiB = 2**20


def add_model_args(p, vocab: int = 512) -> None:
    """The options of make_checkpoint's random Qwen3-MoE, shared by the benchmarks that build one."""
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--width", type=int, default=256, help="moe_intermediate_size")
    p.add_argument("--vocab", type=int, default=vocab, help="at most the tiny tokenizer's 512 where text is tokenized")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")


def model_fields(args) -> dict:
    """The Qwen3-MoE config fields of add_model_args' options: heads of 64, two query heads to a key/value head."""
    heads = args.hidden // 64
    return dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        head_dim=64,
        num_experts=args.experts,
        num_experts_per_tok=args.topk,
        moe_intermediate_size=args.width,
    )


def make_checkpoint(args, directory: str) -> str:
    hf = make_tiny(
        "qwen3_moe", os.path.join(directory, "hf"), dtype=args.dtype, **model_fields(args), mlp_only_layers=[]
    )
    return convert_hf(hf, os.path.join(directory, "ck"), progress=False)


def rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) * 1024


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports kB


def reset_peak() -> None:
    """Start the high-water mark afresh from the current RSS (Linux >= 4.0); without it the mark
    may still hold an earlier peak, which only makes the figures below pessimistic."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def rank_run(ck: str, ep: int, ids: torch.Tensor, dtype_name: str, iters: int) -> dict:
    import torch.distributed as dist

    from eprt.parallel import ParallelState

    dtype = DTYPES[dtype_name]
    with ParallelState.from_env(ep=ep) as state:
        mine = ids[state.rank :: state.world]
        reset_peak()
        before = rss()
        model = eprt.load_model(ck, dtype=dtype, parallel=state)
        loaded = rss()
        times = []
        with torch.inference_mode():
            for _ in range(iters + 1):
                if state.world > 1:
                    dist.barrier()
                start = time.perf_counter()
                model(mine)
                times.append(time.perf_counter() - start)
        peak = peak_rss()
        dense, experts = weight_bytes(
            ResolvedCheckpoint.of(Checkpoint(ck), dtype, state.placement(model.config.num_experts).range)
        )
    return {
        "times": times[1:],
        "peak": peak - before,
        "activations": max(0, peak - loaded),
        "dense": dense,
        "experts": experts,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_args(p, vocab=4096)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--batch", type=int, default=8, help="global batch: sequences over all ranks")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()

    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    results = {}
    with tempfile.TemporaryDirectory() as d:
        ck = make_checkpoint(args, d)
        for ep in args.ep:
            os.environ["MASTER_PORT"] = str(free_port())
            results[ep] = run_world(rank_run, ep, ck, ep, ids, args.dtype, args.iters, timeout=600)

    tokens = args.batch * args.seq
    base = results.get(1)
    print(
        f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.topk} "
        f"(width {args.width}), vocab {args.vocab}, {args.dtype}; global batch {args.batch} x {args.seq} "
        f"= {tokens} tokens; world = ep, 1 thread per rank, gloo, {os.cpu_count()} CPUs"
    )
    print(
        f"{'ep':>3} {'tokens/s':>9} {'speedup':>8} {'rank':>5} {'peak MiB':>9} {'vs ep 1':>8} "
        f"{'dense':>7} {'experts':>8} {'activ.':>7} {'sum MiB':>8} {'peak/sum':>9}"
    )
    for ep, ranks in results.items():
        step = min(max(r["times"][i] for r in ranks) for i in range(args.iters))
        rate = tokens / step
        speedup = f"{rate / (tokens / min(base[0]['times'])):.2f}x" if base else "-"
        for rank, r in enumerate(ranks):
            expected = r["dense"] + r["experts"] + r["activations"]
            vs_single = f"{r['peak'] / base[0]['peak']:.2f}x" if base else "-"
            head = f"{ep:>3} {rate:>9.0f} {speedup:>8}" if rank == 0 else " " * 21
            print(
                f"{head} {rank:>5} {r['peak'] / MiB:>9.1f} {vs_single:>8} {r['dense'] / MiB:>7.1f} "
                f"{r['experts'] / MiB:>8.1f} {r['activations'] / MiB:>7.1f} {expected / MiB:>8.1f} "
                f"{r['peak'] / expected:>8.2f}x"
            )


if __name__ == "__main__":
    main()
