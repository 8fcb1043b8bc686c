"""Loading a compressed checkpoint: each rank's load time and peak memory against loading a bf16
copy of the same model, and the disk bytes of each eprt checkpoint against its source.

    python bench/load.py [--format int4|mxfp4|fp8-block] [--layers 4] [--hidden 512] [--experts 32]
                         [--width 256] [--vocab 4096] [--ep 1 2]

One random Kimi-K2 (deepseek_v3 architecture; make_tiny with these sizes, every layer but the
first MoE) whose routed experts the compressed-tensors library compresses as Kimi-K2-Thinking
ships them (INT4 pack-quantized; mxfp4: as Kimi-K3; fp8-block: every Linear, as DeepSeek-V3),
converted as it is; and its bf16 copy (export_hf --dequantize, converted). Each is loaded in
bf16 by a fresh world of ep CPU processes (gloo, one thread each). Reported per ep and rank:
- load s: the wall time of load_model(parallel=...), compressed-tensors imported beforehand
  (its import, which pulls in transformers, is reported apart);
- peak MiB: the RSS high-water mark (reset once torch is loaded) above the RSS before loading;
- held MiB: the weights the loaded model holds (dense + its experts, from the manifest), and
  layer MiB: one MoE layer's decoded share of this rank's experts, which bounds what loading
  holds beyond the model.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eprt  # noqa: E402
from bench.ep import peak_rss, reset_peak, rss  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.loading.loader import weight_bytes  # noqa: E402
from eprt.loading.resolved import ResolvedCheckpoint  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.multiproc import free_port, run_world  # noqa: E402

MiB = 2**20
MODELS = {
    "int4": "Kimi-K2 with INT4 experts",
    "mxfp4": "Kimi-K2 with MXFP4 experts",
    "fp8-block": "DeepSeek-V3 in block FP8",
}


def make_checkpoints(args, d: str) -> dict[str, tuple[str, str]]:
    """{"compressed" | "bf16": (Hugging Face dir, eprt checkpoint)}."""
    overrides = dict(model_type="kimi_k2", num_nextn_predict_layers=0) if args.format != "fp8-block" else {}
    hf = make_tiny(
        "deepseek_v3",
        os.path.join(d, "hf"),
        source_format=args.format,
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=2 * args.hidden,
        num_hidden_layers=args.layers,
        n_routed_experts=args.experts,
        moe_intermediate_size=args.width,
        num_experts_per_tok=4,
        **overrides,
    )
    ck = convert_hf(hf, os.path.join(d, "ck"), progress=False)
    plain = export_hf(ck, os.path.join(d, "bf16-hf"), dequantize=True, progress=False)
    return {"compressed": (hf, ck), "bf16": (plain, convert_hf(plain, os.path.join(d, "bf16-ck"), progress=False))}


def rank_load(ck: str, ep: int) -> dict:
    from eprt.parallel import ParallelState
    from eprt.storage.encodings import library

    start = time.perf_counter()
    library("bench")
    imported = time.perf_counter() - start
    with ParallelState.from_env(ep=ep) as state:
        reset_peak()
        before = rss()
        start = time.perf_counter()
        model = eprt.load_model(ck, dtype=torch.bfloat16, parallel=state)
        seconds = time.perf_counter() - start
        peak = peak_rss() - before
        c = model.config
        first, count = state.placement(c.num_experts).range
        dense, experts = weight_bytes(ResolvedCheckpoint.of(Checkpoint(ck), torch.bfloat16, (first, count)))
        layer = count * 3 * c.moe.intermediate_size * c.hidden_size * 2
    return {"import": imported, "seconds": seconds, "peak": peak, "held": dense + experts, "layer": layer}


def weight_file_bytes(d: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(d) for f in fs if f.endswith(".safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--format", choices=["int4", "mxfp4", "fp8-block"], default="int4")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--width", type=int, default=256, help="moe_intermediate_size")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--ep", type=int, nargs="+", default=[1, 2])
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as d:
        ckpts = make_checkpoints(args, d)
        disk = {kind: (weight_file_bytes(hf), weight_file_bytes(ck)) for kind, (hf, ck) in ckpts.items()}
        results = {}
        for ep in args.ep:
            for kind, (_, ck) in ckpts.items():
                os.environ["MASTER_PORT"] = str(free_port())
                results[ep, kind] = run_world(rank_load, ep, ck, ep, timeout=600)

    imports = [r["import"] for rs in results.values() for r in rs]
    print(
        f"{MODELS[args.format]}, {args.layers} layers, hidden {args.hidden}, {args.experts} experts "
        f"(width {args.width}), vocab {args.vocab}, against a bf16 copy; loaded in bf16; "
        f"world = ep, 1 thread per rank, {os.cpu_count()} CPUs; compressed-tensors import "
        f"{min(imports):.1f}-{max(imports):.1f} s per process, not in the load times"
    )
    for kind, (src, ck) in disk.items():
        print(f"disk {kind:>10}: source {src / MiB:8.1f} MiB, eprt checkpoint {ck / MiB:8.1f} MiB ({ck / src:.3f}x)")
    print(f"disk compressed / bf16 eprt checkpoint: {disk['compressed'][1] / disk['bf16'][1]:.3f}x")
    print(
        f"{'ep':>3} {'rank':>5} {'load s':>7} {'bf16 s':>7} {'ratio':>6} {'peak MiB':>9} {'bf16 MiB':>9} "
        f"{'ratio':>6} {'held MiB':>9} {'layer MiB':>10}"
    )
    for ep in args.ep:
        for rank, (c, b) in enumerate(zip(results[ep, "compressed"], results[ep, "bf16"])):
            print(
                f"{ep:>3} {rank:>5} {c['seconds']:>7.2f} {b['seconds']:>7.2f} {c['seconds'] / b['seconds']:>5.2f}x "
                f"{c['peak'] / MiB:>9.1f} {b['peak'] / MiB:>9.1f} {c['peak'] / b['peak']:>5.2f}x "
                f"{c['held'] / MiB:>9.1f} {c['layer'] / MiB:>10.1f}"
            )


if __name__ == "__main__":
    main()
