"""Tiny random Hugging Face checkpoints in the real layout: the built-in model of the demo and the tests."""

from __future__ import annotations

import json
import os
import re

import torch
from safetensors.torch import save_file

from eprt.atomic import atomic_output_dir, copy_files
from eprt.config import parse_hf_config, reader_for
from eprt.layout import Layout, plain

TINY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny")
TOKENIZER_FILES = ["tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def families() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(TINY_DIR) if f.endswith(".json") and f[:-5] not in
                  {n[:-5] for n in TOKENIZER_FILES})


def tiny_config(family: str, **overrides) -> dict:
    path = os.path.join(TINY_DIR, f"{family}.json")
    if not os.path.isfile(path):
        raise ValueError(f"no tiny config for {family!r}; choose one of {', '.join(families())}")
    with open(path) as f:
        return {**json.load(f), **overrides}


def init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random values with roughly the statistics of a trained model, per kind of tensor."""
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if len(shape) == 1:  # norms
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if re.search(r"\.mlp\.gate\.weight$", name):  # routers: spread enough that routing is not a tie
        return 0.5 * torch.randn(shape, generator=g)
    return 0.02 * torch.randn(shape, generator=g) * (5.0 if "embed_tokens" in name else 1.0)


def mtp_layout(hf: dict) -> Layout:
    """DeepSeek-V3's multi-token-prediction layers: a decoder layer plus its own norms and projection."""
    n, k = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers", 0)
    big = parse_hf_config({**hf, "num_hidden_layers": n + k, "num_nextn_predict_layers": 0})
    H, V = big.hidden_size, big.vocab_size
    specs = []
    for layer in range(n, n + k):
        p = f"model.layers.{layer}."
        specs += [s for s in reader_for(big.model_type, "tiny").layout(big).specs if s.name.startswith(p)]
        specs += [plain(p + "enorm.weight", H), plain(p + "hnorm.weight", H), plain(p + "eh_proj.weight", H, 2 * H),
                  plain(p + "embed_tokens.weight", V, H), plain(p + "shared_head.norm.weight", H),
                  plain(p + "shared_head.head.weight", V, H)]
    return Layout(tuple(specs))


def make_tiny(family: str, out: str, *, seed: int = 0, shards: int = 1, dtype: str = "bf16",
              overwrite: bool = False, **overrides) -> str:
    """Write a random checkpoint of `family` (config from configs/tiny, `overrides` on top) to `out`."""
    hf = tiny_config(family, **overrides)
    hf["torch_dtype"] = {"bf16": "bfloat16", "fp32": "float32"}[dtype]
    cfg = parse_hf_config(hf, f"tiny {family}")
    layout = reader_for(cfg.model_type, "tiny").layout(cfg)
    specs = list(layout.specs)
    if cfg.num_nextn_predict_layers:
        specs += mtp_layout(hf).specs
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for spec in specs:
        for src in spec.sources:
            t = init(src, spec.source_shape(), g)
            tensors[src] = t if src.endswith("e_score_correction_bias") else t.to(DTYPES[dtype])
    names = list(tensors)
    with atomic_output_dir(out, overwrite=overwrite) as tmp:
        if shards == 1:
            save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
        else:
            weight_map = {}
            per = -(-len(names) // shards)
            for i in range(shards):
                fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
                part = {n: tensors[n] for n in names[i * per:(i + 1) * per]}
                save_file(part, os.path.join(tmp, fname), metadata={"format": "pt"})
                weight_map.update({n: fname for n in part})
            total = sum(t.numel() * t.element_size() for t in tensors.values())
            with open(os.path.join(tmp, "model.safetensors.index.json"), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(hf, f, indent=2)
        copy_files(TINY_DIR, TOKENIZER_FILES, tmp)
    return out
