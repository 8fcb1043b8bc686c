"""PTQ on this machine: calibration tokens/s and each rank's peak memory at ep 1, 2 and 4.

    python bench/ptq.py [--recipe nvfp4] [--ep 1 2 4] [--calib-size 16] [--seq-len 128] [--layers 4] ...
        [--algorithm awq] [--calibrate-all-experts]

One random Qwen3-MoE (bench/ep.py's model: every layer MoE, so that the routed experts hold
most of the bytes) is calibrated on the same global data in worlds of ep CPU processes on gloo
(world = ep, one thread each), with the FP8 KV cache. Reported per ep: global calibration
tokens over the slowest rank's calibration time (the layer loop, which reads each layer's
weights as it goes; the data and the output excluded), and each rank's peak RSS above its RSS
before the run, beside the single process's.
"""

import argparse
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.ep import MiB, add_model_args, make_checkpoint, peak_rss, reset_peak, rss  # noqa: E402
from tests.multiproc import free_port, run_world  # noqa: E402


def rank_ptq(ck: str, ep: int, out: str, args) -> dict:
    from eprt.parallel import ParallelState
    from eprt.quant.run.ptq import PTQArgs, run_ptq

    with ParallelState.from_env(ep=ep) as state:
        reset_peak()
        before = rss()
        result = run_ptq(
            state,
            PTQArgs(
                ck,
                args.recipe,
                out,
                kv_cache="fp8",
                calib_size=args.calib_size,
                seq_len=args.seq_len,
                batch_size=args.batch_size,
                dtype=args.dtype,
                algorithm=args.algorithm,
                calibrate_all_experts=args.calibrate_all_experts,
                progress=False,
            ),
        )
        return {**result, "peak": peak_rss() - before}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recipe", default="nvfp4")
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--calib-size", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--algorithm", default="max")
    p.add_argument("--calibrate-all-experts", action="store_true")
    add_model_args(p)
    args = p.parse_args()

    results = {}
    with tempfile.TemporaryDirectory() as d:
        ck = make_checkpoint(args, d)
        for ep in args.ep:
            os.environ["MASTER_PORT"] = str(free_port())
            results[ep] = run_world(rank_ptq, ep, ck, ep, os.path.join(d, f"q{ep}"), args, timeout=900)

    tokens = args.calib_size * args.seq_len
    print(
        f"{args.recipe} ({args.algorithm}{', every expert' if args.calibrate_all_experts else ''}) + FP8 KV on "
        f"Qwen3-MoE {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
        f"top-{args.topk}, {args.dtype}; {args.calib_size} x {args.seq_len} = {tokens} calibration tokens, "
        f"batch {args.batch_size} per rank; world = ep, 1 thread per rank, gloo, {os.cpu_count()} CPUs"
    )
    print(f"{'ep':>3} {'tokens/s':>9} {'vs ep 1':>8} {'rank':>5} {'peak MiB':>9} {'vs ep 1':>8}")
    base = results.get(1)
    for ep, ranks in results.items():
        rate = tokens / max(r["calibration_s"] for r in ranks)
        speed = f"{rate / (tokens / base[0]['calibration_s']):.2f}x" if base else "-"
        for rank, r in enumerate(ranks):
            mem = f"{r['peak'] / base[0]['peak']:.2f}x" if base else "-"
            head = f"{ep:>3} {rate:>9.0f} {speed:>8}" if rank == 0 else " " * 21
            print(f"{head} {rank:>5} {r['peak'] / MiB:>9.1f} {mem:>8}")


if __name__ == "__main__":
    main()
