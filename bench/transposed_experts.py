"""The model-free export of routed experts stored transposed against the same experts stored
[experts, out, in], side by side: what reading each expert from its entry of an [E, in, out] stack
and copying it into [out, in] costs.

    python bench/transposed_experts.py [--hidden 1024] [--experts 32] [--layers 2] [--runs 3]

Writes one random bf16 checkpoint in OLMoE's names with each layer's experts stacked as transformers 5
holds them (`gate_up_proj` [E, 2I, D], `down_proj` [E, D, I]) and the same weights transposed
(`gate_up_proj` [E, D, 2I], `down_proj` [E, I, D]), then exports each with `fp8_block` in turn (A B A B
...), one worker, and prints each side's wall seconds (median) and the ratio transposed / stacked,
pair by pair. The two exports are the same bytes (checked)."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from eprt.hf.streaming import stream_export  # noqa: E402
from tests.hf_utils import tree_digest  # noqa: E402


def write(d: str, a: argparse.Namespace, transposed: bool) -> str:
    os.makedirs(d)
    D, I, E = a.hidden, a.hidden // 2, a.experts
    g = torch.Generator().manual_seed(0)
    t = {"model.embed_tokens.weight": torch.randn(1024, D, generator=g).bfloat16()}
    for i in range(a.layers):
        p = f"model.layers.{i}"
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            t[f"{p}.self_attn.{proj}.weight"] = torch.randn(D, D, generator=g).bfloat16()
        t[f"{p}.mlp.gate.weight"] = torch.randn(E, D, generator=g).bfloat16()
        stacks = {"gate_up_proj": (E, 2 * I, D), "down_proj": (E, D, I)}
        for name, shape in stacks.items():
            w = (0.02 * torch.randn(shape, generator=g)).bfloat16()
            t[f"{p}.mlp.experts.{name}"] = w.transpose(1, 2).contiguous() if transposed else w
    t["lm_head.weight"] = torch.randn(1024, D, generator=g).bfloat16()
    save_file(t, os.path.join(d, "model.safetensors"))
    config = {"model_type": "olmoe", "hidden_size": D, "num_hidden_layers": a.layers, "vocab_size": 1024}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(config, f)
    return d


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    root = tempfile.mkdtemp()
    sides = {"stacked": write(f"{root}/stacked", a, False), "transposed": write(f"{root}/transposed", a, True)}
    size = os.path.getsize(f"{root}/stacked/model.safetensors")
    times: dict[str, list[float]] = {k: [] for k in sides}
    outs = {}
    for run in range(a.runs + 1):  # the first pair warms up
        for side, hf in sides.items():
            out = f"{root}/out-{side}-{run}"
            start = time.perf_counter()
            stream_export(hf, out, "fp8_block", workers=1, progress=False)
            if run:
                times[side].append(time.perf_counter() - start)
            outs[side] = out
    same = {k: v.split("@")[0] for k, v in tree_digest(outs["stacked"]).items()} == {
        k: v.split("@")[0] for k, v in tree_digest(outs["transposed"]).items()
    }
    ratios = [t / s for t, s in zip(times["transposed"], times["stacked"])]
    print(f"checkpoint {size / 2**20:.0f} MiB, fp8_block, {a.runs} runs each, one worker")
    for side in sides:
        print(f"  {side}: {statistics.median(times[side]):.2f} s (median of {times[side]})")
    print(f"  transposed / stacked: {statistics.median(ratios):.2f}x (pair by pair: {[round(r, 2) for r in ratios]})")
    print(f"  the same bytes: {same}")


if __name__ == "__main__":
    main()
