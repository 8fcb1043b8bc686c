"""Forward throughput of eprt's Qwen3-MoE against transformers' on the same random weights.

    python bench/forward.py [--layers 8] [--hidden 512] [--experts 32] [--batch 4] [--seq 256] [--iters 3]

One random Qwen3-MoE (about 100M parameters by default) is saved with save_pretrained in bf16,
converted, and loaded by both: transformers with from_pretrained, eprt with load_model. Both run
the same token batches in bf16 on the CPU, alternating, after one warm-up pass each; the report
is tokens per second of each (best of --iters) and their ratio.
"""

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import eprt  # noqa: E402
from bench.ep import model_fields  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402


def make_checkpoint(args, directory: str) -> tuple[str, int]:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        **model_fields(args), intermediate_size=4 * args.hidden, norm_topk_prob=True, max_position_embeddings=4096
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # routers spread enough that tokens do not all pick the same experts
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.3)
    params = sum(p.numel() for p in model.parameters())
    hf = os.path.join(directory, "hf")
    model.to(torch.bfloat16).save_pretrained(hf)
    del model
    return convert_hf(hf, os.path.join(directory, "ck"), progress=False), params


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--width", type=int, default=192, help="moe_intermediate_size")
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--iters", type=int, default=3)
    args = p.parse_args()

    from transformers import Qwen3MoeForCausalLM

    with tempfile.TemporaryDirectory() as d:
        ck, params = make_checkpoint(args, d)
        ref = Qwen3MoeForCausalLM.from_pretrained(os.path.join(d, "hf"), dtype=torch.bfloat16).eval()
        ours = eprt.load_model(ck, dtype=torch.bfloat16)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    runs = {"transformers": lambda: ref(ids).logits, "eprt": lambda: ours(ids)}
    best = dict.fromkeys(runs, float("inf"))
    with torch.inference_mode():
        diff = (runs["eprt"]().float() - runs["transformers"]().float()).abs().max().item()  # also the warm-up
        for _ in range(args.iters):
            for name, run in runs.items():
                t = time.perf_counter()
                run()
                best[name] = min(best[name], time.perf_counter() - t)
    tokens = args.batch * args.seq
    print(
        f"Qwen3-MoE {params / 1e6:.0f}M parameters, {args.layers} layers, {args.experts} experts top-{args.topk}, "
        f"bf16, {torch.get_num_threads()} threads, {args.batch} x {args.seq} tokens"
    )
    for name in runs:
        print(f"  {name:13s} {tokens / best[name]:10.0f} tokens/s  ({best[name]:.3f} s per forward)")
    print(
        f"  eprt / transformers throughput: {best['transformers'] / best['eprt']:.2f}x"
        f"   (max |logit difference| {diff:.3g})"
    )


if __name__ == "__main__":
    main()
