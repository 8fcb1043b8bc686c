"""A calibrated eprt checkpoint -> the ModelOpt Hugging Face layout (docs/export.md), which vLLM,
SGLang and TensorRT-LLM load as `quant_method: modelopt`.

Scales follow the engines' fusion rules: gate and up of one expert share a weight amax; every
expert of a layer gets the layer's largest input amax per projection kind, also the experts no
token reached; with NVFP4, Linears that read the same input (q/k/v, gate/up, DeepSeek's q_a_proj
and kv_a_proj_with_mqa) share input amax and per-tensor weight amax, because the engine fuses
them under one weight_scale_2 (eprt.quant.fusion).
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

import torch

from eprt import __version__
from eprt.families import reader_for
from eprt.hf.tensors import OutTensor, source_tensors
from eprt.layout import Layout, TensorSpec, layer_of
from eprt.quant.feasibility import quantized_modules
from eprt.quant.fp8 import fp8_scale, quantize_fp8
from eprt.quant.fusion import siblings
from eprt.quant.nvfp4 import BLOCK_SIZE, nvfp4_scale, quantize_nvfp4
from eprt.quant.recipe import parse_recipe
from eprt.storage.checkpoint import Checkpoint

ALGO = {"fp8": "FP8", "nvfp4": "NVFP4"}
PRODUCER = {"name": "modelopt", "version": "0.47.0", "exported_by": f"eprt {__version__}"}


@dataclass(frozen=True)
class ExpertWeight:
    """One Hugging Face expert weight inside a stacked tensor: rows k of expert e of `spec`."""
    module: str  # the experts module, e.g. model.layers.3.mlp.experts
    spec: TensorSpec
    expert: int
    piece: int


class QuantizedExport:
    def __init__(self, ck: Checkpoint):
        self.ck = ck
        self.recipe = parse_recipe(ck.quantization["recipe"], f"{ck.path} (recipe)")
        self.fmt = self.recipe.weight_format
        self.layout: Layout = reader_for(ck.config.model_type, ck.path).layout(ck.config)
        self.quantized = quantized_modules(self.layout, self.recipe, ck.path)
        self.amax = {n: ck.read(n) for n in ck.names(role="calibration")}
        self.experts = {src: ExpertWeight(spec.name.rsplit(".", 1)[0], spec, *divmod(j, spec.per_row))
                        for spec in self.layout.specs if spec.stacked and spec.name.rsplit(".", 1)[0] in self.quantized
                        for j, src in enumerate(spec.sources)}

    # --- amax -------------------------------------------------------------------------------
    @functools.lru_cache(maxsize=None)
    def weight_amax(self, module: str) -> torch.Tensor:
        return max(self.ck.read(f"{m}.weight").abs().amax().float() for m in siblings(module, self.quantized, self.fmt))

    def input_amax(self, module: str) -> torch.Tensor:
        return max(self.amax[f"{m}.input_amax"] for m in siblings(module, self.quantized, self.fmt))

    # --- quantization -----------------------------------------------------------------------
    def scale(self, amax) -> torch.Tensor:
        return fp8_scale(amax) if self.fmt == "fp8" else nvfp4_scale(amax)

    @functools.lru_cache(maxsize=4)
    def expert_row(self, name: str, e: int) -> torch.Tensor:
        return self.ck.read(name, rows=(e, e + 1))[0]

    @functools.lru_cache(maxsize=4)
    def expert_amax(self, name: str, e: int) -> torch.Tensor:
        """Gate and up of one expert (one row of w13) share one weight amax: computed once for both."""
        return self.expert_row(name, e).abs().amax().float()

    @functools.lru_cache(maxsize=2)
    def quantize(self, hf_weight: str) -> dict[str, torch.Tensor]:
        """Every tensor of one quantized Linear, by suffix (weight, weight_scale, ...)."""
        if hf_weight in self.experts:
            x = self.experts[hf_weight]
            row = self.expert_row(x.spec.name, x.expert)
            h = row.shape[0] // x.spec.per_row
            w = row[x.piece * h:(x.piece + 1) * h]
            w_amax = self.expert_amax(x.spec.name, x.expert)
            kind = x.spec.name.rsplit(".", 1)[1]  # w13 or w2
            in_amax = self.amax[f"{x.module}.{kind}_input_amax"].max()  # the layer's largest
        else:
            module = hf_weight[: -len(".weight")]
            w = self.ck.read(hf_weight)
            w_amax, in_amax = self.weight_amax(module), self.input_amax(module)
        w_scale = self.scale(w_amax)
        out = {"input_scale": self.scale(in_amax)}
        if self.fmt == "fp8":
            # FP8 rounds the quotient to the weight's dtype first (eprt.quant.fp8): the source's
            # dtype, as the source is held when loaded as it is, whatever dtype eprt converted it to.
            source_dtype = self.ck.meta(x.spec.name if hf_weight in self.experts else hf_weight).source_dtype
            out.update(weight=quantize_fp8(w.to(source_dtype), w_scale), weight_scale=w_scale)
        else:
            q, block_scale = quantize_nvfp4(w, w_scale)
            out.update(weight=q, weight_scale=block_scale, weight_scale_2=w_scale)
        return out

    def quantized_out(self, t: OutTensor) -> list[OutTensor]:
        module = t.name[: -len(".weight")]
        out_dim, in_dim = t.shape
        if self.fmt == "fp8":
            shapes = {"weight": (torch.float8_e4m3fn, (out_dim, in_dim)), "weight_scale": (torch.float32, ()),
                      "input_scale": (torch.float32, ())}
        else:
            shapes = {"weight": (torch.uint8, (out_dim, in_dim // 2)),
                      "weight_scale": (torch.float8_e4m3fn, (out_dim, in_dim // BLOCK_SIZE)),
                      "weight_scale_2": (torch.float32, ()), "input_scale": (torch.float32, ())}
        return [OutTensor(f"{module}.{k}", dtype, shape, lambda w=t.name, k=k: self.quantize(w)[k])
                for k, (dtype, shape) in shapes.items()]

    def is_quantized(self, hf_name: str) -> bool:
        return hf_name in self.experts or (hf_name.endswith(".weight") and hf_name[: -len(".weight")] in self.quantized)

    # --- the whole export -------------------------------------------------------------------
    def tensors(self) -> list[OutTensor]:
        out = []
        # from the decoded weights: an encoded source weight left unquantized is written in bf16
        for t in source_tensors(self.ck, dequantize=True):
            out += self.quantized_out(t) if self.is_quantized(t.name) else [t]
        if self.recipe.kv_cache:
            for name, kind in sorted((n, k) for n in self.amax for k in ("k", "v") if n.endswith(f".{k}_amax")):
                attn = name[: -len(f".{kind}_amax")]
                scale = fp8_scale(self.amax[name])
                out.append(OutTensor(f"{attn}.{kind}_proj.{kind}_scale", torch.float32, (), lambda s=scale: s))
        return out

    def excluded(self) -> list[str]:
        """exclude_modules: the Linear-like modules left unquantized, summarized by prefix wildcards
        as ModelOpt summarizes them (`summarize_excluded`), then what travels through unquantized
        and unmodeled (DeepSeek's MTP layers, a vision tower), one pattern each."""
        quantized, unquantized = set(), set()
        for spec in self.layout.specs:
            if spec.stacked:
                modules = {src[: -len(".weight")] for src in spec.sources}
                (quantized if spec.name.rsplit(".", 1)[0] in self.quantized else unquantized).update(modules)
            elif spec.name.endswith(".weight") and len(spec.shape) == 2:
                module = spec.name[: -len(".weight")]
                (quantized if module in self.quantized else unquantized).add(module)
        names = summarize_excluded(unquantized, quantized)
        for name in self.ck.names(role="passthrough"):
            layer = layer_of(name)
            names.add(re.sub(r"(layers\.\d+)\..*", r"\1.*", name) if layer is not None else carried(name, quantized))
        return sorted(names)

    def configs(self) -> tuple[dict, dict]:
        """(config.json, hf_quant_config.json)."""
        algo, excluded = ALGO[self.fmt], self.excluded()
        kv = "FP8" if self.recipe.kv_cache == "fp8" else None
        quant = {"quant_algo": algo, "kv_cache_quant_algo": kv, "exclude_modules": excluded}
        group = {"dynamic": False, "num_bits": 8, "type": "float"}
        if self.fmt == "nvfp4":
            quant["group_size"] = BLOCK_SIZE
            group = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": BLOCK_SIZE}
        qc = {"quant_method": "modelopt", "quant_algo": algo,
              "config_groups": {"group_0": {"targets": ["Linear"], "weights": group, "input_activations": group}},
              "ignore": excluded, "producer": PRODUCER}
        if kv:
            qc["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
        config = {**self.ck.source_config, "quantization_config": qc}
        return config, {"producer": PRODUCER, "quantization": quant}


def carried(name: str, quantized: set[str]) -> str:
    """`P.*` for the shortest dotted prefix P of a carried tensor that holds no quantized module:
    `vision_tower.*`, or `model.visual.*` beside a quantized `model.language_model`."""
    cuts = [i for i, c in enumerate(name) if c == "."]
    return next((name[:i] + ".*" for i in cuts if not any(q.startswith(name[:i + 1]) for q in quantized)), name)


def summarize_excluded(unquantized: set[str], quantized: set[str]) -> set[str]:
    """ModelOpt's exclude_modules for these module names (its export's prefix-wildcard summary).

    Each unquantized module is named by the first of `P*` (cut at each dot, left to right), then
    the pair `P`, `P.*` (written as `P.*` alone), then its own name, that covers no quantized
    module: a prefix wildcard `Q[:i]*` of a quantized Q, or Q itself, is never used. So a layer
    whose Linears all stay unquantized is one `model.layers.1*`, while an excluded lm_head next
    to quantized model.* modules stays `lm_head`. Every engine reads these patterns (vLLM splits
    `P*` into `P` and `P.*`)."""
    taken = {q[:i] + "*" for q in quantized for i in range(len(q) + 1)} | quantized
    out: set[str] = set()
    for module in sorted(unquantized):
        cuts = [i for i, c in enumerate(module) if c == "."]
        candidates = [w for i in cuts for w in ([module[:i] + "*"], [module[:i], module[:i] + ".*"])] + [[module]]
        chosen = next(c for c in candidates if not any(w in taken for w in c))
        out.add(chosen[-1])  # the pair is written as its `P.*`
    return out
