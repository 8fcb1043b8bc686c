"""A calibrated eprt checkpoint -> a quantized Hugging Face layout (docs/export.md): ModelOpt's,
which vLLM, SGLang and TensorRT-LLM load as `quant_method: modelopt` (one format, or
MIXED_PRECISION), or compressed-tensors' (eprt.hf.compressed_tensors_export), with the same
quantized values.

Scales follow the engines' fusion rules, resolved in one place (eprt.quant.scales).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass
from typing import Callable

import torch

from eprt.errors import ConfigError
from eprt.families import reader_for
from eprt.hf import compressed_tensors_export as ct
from eprt.hf import mxfp4_blocks_export as mx
from eprt.hf.quant_configs import QuantizedLinears, ct_config, modelopt_configs
from eprt.hf.tensors import OutTensor, source_tensors
from eprt.kernels.cpu_workers import for_each, worker_count
from eprt.layout import EXPERT_LEAVES, Layout, TensorSpec, layer_of
from eprt.quant.calibrated import CalibrationRecord
from eprt.quant.feasibility import quantized_modules
from eprt.quant.formats import WeightFormat, weight_format
from eprt.quant.formats.base import CT_SCALAR
from eprt.quant.formats.kv import kv_cache_format
from eprt.quant.recipe import Recipe, parse_recipe
from eprt.quant.rotation.rotated import RotatedCheckpoint
from eprt.quant.scales import Scales, as_quantized
from eprt.storage.checkpoint import Checkpoint
from eprt.storage.mxfp4_blocks import MXFP4_BLOCKS

# Expert rows quantized at once: at least one a CPU worker, up to this many weights. At the end
# of a batch the first worker done waits for the last: batches of 32M weights (64 MiB in bf16;
# 28 gate/up rows of the bench model, where 2 a worker made 4) cut its export ~6%.
BATCH_ELEMENTS = 1 << 25


@dataclass(frozen=True)
class ExpertWeight:
    """One Hugging Face expert weight inside a stacked tensor: rows k of expert e of `spec`."""

    module: str  # the experts module, e.g. model.layers.3.mlp.experts
    spec: TensorSpec
    expert: int
    piece: int


LAYOUTS = ("modelopt", ct.NAME)  # the layouts an export is written in (`--format`)
# and the one a modeled export also writes: GPT-OSS's release layout of its MXFP4 experts
MODELED_LAYOUTS = (*LAYOUTS, mx.NAME)


def is_expert_weight(spec: TensorSpec) -> bool:
    """Whether stacked `spec` holds routed experts' weights (a projection of EXPERT_LEAVES), not
    their biases: the biases of quantized experts stay unquantized, written per expert beside
    the quantized weights (`...experts.E.down_proj.bias`), as the engines load them."""
    return spec.stacked and spec.name.rsplit(".", 1)[1] in EXPERT_LEAVES


class QuantizedExport:
    """The tensors and configs of the export of calibrated checkpoint `ck` in `layout` (MODELED_LAYOUTS),
    or with `recipe`, of unquantized `ck` under that data-free recipe (eprt.quant.run.datafree): the
    same export as after its calibration, whose record holds nothing these formats read."""

    def __init__(self, ck: Checkpoint, layout: str | None = "modelopt", recipe: Recipe | None = None):
        if layout not in (*MODELED_LAYOUTS, None):
            raise ConfigError(f"--format {layout!r}: choose one of {', '.join(MODELED_LAYOUTS)}")
        self.recipe = recipe or parse_recipe(ck.quantization["recipe"], f"{ck.path} (recipe)")
        # None: the layout that holds the recipe (`holding_layout`)
        self.ck, self.target = ck, layout or holding_layout(self.recipe.formats)
        layout = self.target
        self.layout: Layout = reader_for(ck.config.model_type, ck.path).layout(ck.config)
        self.quantized = quantized_modules(self.layout, self.recipe, ck.path)
        # The multi-token-prediction layers the recipe quantizes a module of are modeled like the
        # decoder's (their Linears quantized or excluded by name); the others travel through whole.
        self.mtp_layers = {layer_prefix(m) for m in self.quantized} & {layer_prefix(s.name) for s in self.layout.mtp}
        self.specs = (*self.layout.specs, *(s for s in self.layout.mtp if layer_prefix(s.name) in self.mtp_layers))
        self.record = CalibrationRecord.read(ck)
        opened = ck
        if self.recipe.rotates:  # every weight is read rotated, as the run read it
            ck = RotatedCheckpoint(ck)
        # and through every algorithm's view (AWQ's folds), as the run read it
        self.ck = ck = self.record.view(ck)
        self.viewed = ck is not opened  # a tensor read through a view is not its stored bytes
        formats = {m: self.recipe.format_of(m) for m in self.quantized}
        kv = kv_cache_format(self.recipe.kv_cache)
        if layout == ct.NAME and kv is not None and kv.ct_args is None:
            raise ConfigError(
                f"{ck.path}: calibrated with --kv-cache {kv.name}, which the compressed-tensors layout has no "
                f"KV-cache scheme for: export in the ModelOpt layout (without --format {ct.NAME}), or calibrate "
                "with --kv-cache fp8"
            )
        if layout == "modelopt":
            refuse_modelopt_layout(formats, ck.path)
        if layout == mx.NAME:
            fused = {s.name.rsplit(".", 1)[0] for s in self.specs if is_expert_weight(s) and s.fused}
            mx.refuse_unheld(ck.config.model_type, formats, fused, self.recipe.kv_cache, ck.path)
        self.scales = Scales.of_checkpoint(
            ck,
            formats,
            self.record,
            {m: self.recipe.algorithm_of(m) for m in self.quantized},
            self.recipe.scale_headroom,
        )
        self.experts = {
            src: ExpertWeight(spec.name.rsplit(".", 1)[0], spec, *divmod(j, spec.per_row))
            for spec in self.specs
            if is_expert_weight(spec) and spec.name.rsplit(".", 1)[0] in self.quantized
            for j, src in enumerate(spec.sources)
        }
        self.stacked = {spec.name: spec for spec in self.specs if spec.stacked}
        # weights the source spells otherwise (eprt.hf.convert.renamed): the export keeps its names
        self.source_name = {
            s.name: ck.meta(s.name).fused_source
            for s in self.layout.specs
            if not s.stacked and s.name in ck.tensors and ck.meta(s.name).fused_source
        }
        self.eprt_name = {hf: name for name, hf in self.source_name.items()}
        # each layer's routed experts, under the module their per-expert sources name
        self.experts_module = {
            spec.name.rsplit(".", 1)[0]: experts_module(spec) for spec in self.specs if is_expert_weight(spec)
        }
        self._rows: dict[tuple[str, int], dict[str, torch.Tensor]] = {}  # quantized expert rows, a batch

    def expert_row(self, name: str, e: int) -> torch.Tensor:
        module, spec = name.rsplit(".", 1)[0], self.stacked[name]
        # an MTP layer's experts, which the checkpoint holds under their Hugging Face names: as their sources'
        source = name if name in self.ck.tensors else spec.sources[0]
        return as_quantized(self.ck, source, self.scales.formats[module], self.ck.read_expert(spec, e))

    # --- quantization -----------------------------------------------------------------------
    def quantized_row(self, name: str, module: str, e: int) -> dict[str, torch.Tensor]:
        """Expert e's row of stacked `name` (gate and up together, gated experts' first projection) quantized in one call
        under the per-tensor scale gate and up share: rows quantize independently, so each piece
        is a slice of it, the same bytes as quantized alone.

        The export asks for rows in order: e comes with the next rows of `name`, each read and
        quantized whole on a CPU worker (eprt.kernels.cpu_workers). Whole rows side by side keep
        the cores busy, where the steps of one row, split in chunks, leave them waiting on each
        other."""
        if (name, e) not in self._rows:
            spec = self.stacked[name]
            size = max(worker_count(torch.device("cpu")), BATCH_ELEMENTS // max(1, math.prod(spec.shape[1:])))
            rows: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
            for_each(
                range(e, min(spec.shape[0], e + size)),
                lambda: None,
                lambda j, _: rows.__setitem__((name, j), self._quantize_row(name, module, j)),
                torch.device("cpu"),
            )
            self._rows = rows
        return self._rows[(name, e)]

    def _quantize_row(self, name: str, module: str, e: int) -> dict[str, torch.Tensor]:
        w = self.expert_row(name, e)
        scale = self.scales.expert_weight_scale(module, w)
        # gate and up each in blocks of their own where blocks span rows
        out = self.scales.format(module).quantize_stacked(
            w, scale, self.scales.searched(module), self.stacked[name].per_row
        )
        codes = self.record.weight(self.ck, module, name.rsplit(".", 1)[1], e)
        if codes is not None:  # an algorithm's codes (GPTQ's), under the same scales
            out["weight"] = codes
        return out

    @functools.lru_cache(maxsize=2)
    def quantize(self, hf_weight: str) -> dict[str, torch.Tensor]:
        """Every tensor of one quantized Linear, by its ModelOpt suffix (weight, weight_scale, ...)."""
        if hf_weight in self.experts:
            x = self.experts[hf_weight]
            row = self.quantized_row(x.spec.name, x.module, x.expert)
            kind = x.spec.name.rsplit(".", 1)[1]  # a stacked projection's name (eprt.layout.EXPERT_LEAVES)
            inputs = self.input_scale(x.module, lambda: self.scales.expert_input_amax(x.module, kind))
            # each tensor's own piece: rows of codes, rows of a block-scale grid
            return {**inputs, **{k: t.chunk(x.spec.per_row)[x.piece] if t.dim() else t for k, t in row.items()}}
        hf_weight = self.eprt_name.get(hf_weight, hf_weight)
        module = hf_weight[: -len(".weight")]
        w = as_quantized(self.ck, hf_weight, self.scales.formats[module], self.ck.read(hf_weight))
        out = {
            **self.input_scale(module, lambda: self.scales.input_amax(module)),
            **self.scales.quantize_weight(module, w, self.scales.weight_scale(module)),
        }
        codes = self.record.weight(self.ck, module)
        if codes is not None:  # an algorithm's codes (GPTQ's), under the same scales
            out["weight"] = codes
        return out

    def input_scale(self, module: str, amax: Callable[[], torch.Tensor]) -> dict[str, torch.Tensor]:
        """{"input_scale": the scale of `amax()`} for a format whose inputs calibration scales, of the
        amax it pins for one that pins it, else nothing: a data-free format's record holds no input
        amax to ask for."""
        fmt = self.scales.format(module)
        if fmt.pinned_input_scale() is not None:
            return {"input_scale": fmt.pinned_input_scale()}
        return {"input_scale": fmt.scale(amax())} if fmt.uses_activation_statistics else {}

    def format_of(self, hf_weight: str) -> WeightFormat:
        x = self.experts.get(hf_weight)
        return self.scales.format(x.module if x else self.eprt_name.get(hf_weight, hf_weight)[: -len(".weight")])

    def quantized_out(self, t: OutTensor) -> list[OutTensor]:
        module = t.name[: -len(".weight")]
        out_dim, in_dim = t.shape
        fmt = self.format_of(t.name)
        if self.target == ct.NAME:
            return [
                OutTensor(
                    f"{module}.{k}",
                    dtype,
                    shape,
                    lambda w=t.name, k=k, f=fmt: f.to_compressed_tensors(self.quantize(w))[k],
                )
                for k, (dtype, shape) in fmt.compressed_tensors_tensors(out_dim, in_dim).items()
            ]
        return [
            OutTensor(f"{module}.{k}", dtype, shape, lambda w=t.name, k=k: self.quantize(w)[k])
            for k, (dtype, shape) in fmt.modelopt_tensors(out_dim, in_dim).items()
        ]

    def is_quantized(self, hf_name: str) -> bool:
        name = self.eprt_name.get(hf_name, hf_name)
        return name in self.experts or (name.endswith(".weight") and name[: -len(".weight")] in self.quantized)

    def hf_module(self, module: str) -> str:
        """A module's name in the export: the source's spelling of it (a layer's routed experts as
        one `...experts` module, the prefix of their per-expert weights)."""
        if module in self.experts_module:
            return self.experts_module[module]
        return self.source_name.get(f"{module}.weight", f"{module}.weight")[: -len(".weight")]

    # --- the whole export -------------------------------------------------------------------
    def tensors(self) -> list[OutTensor]:
        if self.target == mx.NAME:
            return self.mxfp4_blocks_tensors()
        out = []
        # from the decoded weights: an encoded source weight left unquantized is written in bf16
        for t in source_tensors(self.ck, self.layout, dequantize=True, per_expert=True):
            if self.viewed:  # a folded or rotated tensor is not its stored bytes
                t = dataclasses.replace(t, stored=None)
            out += self.quantized_out(t) if self.is_quantized(t.name) else [t]
        kv = kv_cache_format(self.recipe.kv_cache)
        if kv is not None:
            for attn, amax in sorted(self.record.kv_amax.items()):
                for kind, a in zip("kv", amax):
                    if self.target == ct.NAME:
                        out.append(
                            OutTensor(
                                ct.kv_scale_name(attn, kind),
                                torch.float32,
                                CT_SCALAR,
                                lambda s=kv.scale(a): s.reshape(CT_SCALAR),
                            )
                        )
                    else:
                        out.append(
                            OutTensor(f"{attn}.{kind}_proj.{kind}_scale", torch.float32, (), lambda s=kv.scale(a): s)
                        )
        return out

    def mxfp4_blocks_tensors(self) -> list[OutTensor]:
        """The tensors of the MXFP4 blocks layout (eprt.hf.mxfp4_blocks_export): the source's, fused as
        it stores them, each quantized stack of experts as its blocks and scales."""
        fused = {s.fused: s for s in self.specs if is_expert_weight(s) and s.name.rsplit(".", 1)[0] in self.quantized}
        out = []
        for t in source_tensors(self.ck, self.layout, dequantize=True):
            if self.viewed:  # a folded or rotated tensor is not its stored bytes
                t = dataclasses.replace(t, stored=None)
            spec = fused.get(t.name)
            out += [t] if spec is None else mx.blocks_tensors(spec, functools.partial(self.mxfp4_row, spec.name))
        return out

    def mxfp4_row(self, name: str, e: int) -> dict[str, torch.Tensor]:
        """Expert e's quantized row of stacked `name`, under its MXFP4 source's scales where they hold it."""
        row = self.quantized_row(name, name.rsplit(".", 1)[0], e)
        if self.ck.meta(name).encoding != MXFP4_BLOCKS:
            return row
        return mx.keeping_source_scales(row, self.ck.read_component(name, "scales", (e, e + 1))[0])

    def linear_sets(self) -> tuple[set[str], set[str]]:
        """(quantized, unquantized) Linear-like modules under their Hugging Face names, each routed
        expert's projections one by one."""
        quantized, unquantized = set(), set()
        for spec in self.specs:
            if is_expert_weight(spec):
                modules = {src[: -len(".weight")] for src in spec.sources}
                (quantized if spec.name.rsplit(".", 1)[0] in self.quantized else unquantized).update(modules)
            elif spec.name.endswith(".weight") and len(spec.shape) == 2:
                module = spec.name[: -len(".weight")]
                (quantized if module in self.quantized else unquantized).add(self.hf_module(module))
        return quantized, unquantized

    def hf_weights(self) -> list[str]:
        """The Hugging Face weight of every quantized Linear, each routed expert's projections one by one."""
        return [
            *self.experts,
            *(f"{self.hf_module(m)}.weight" for m in self.quantized if m not in self.stacked_modules()),
        ]

    def stacked_modules(self) -> set[str]:
        return {name.rsplit(".", 1)[0] for name in self.stacked}

    def passthrough_prefixes(self) -> set[str]:
        """What travels through unquantized and unmodeled (DeepSeek's MTP layers the recipe leaves
        whole, a vision tower): one module prefix each (`model.layers.61`, `vision_tower`,
        `model.visual`: see `carried`)."""
        quantized, _ = self.linear_sets()
        return {
            layer_prefix(name) if layer_of(name) is not None else carried(name, quantized)
            for name in self.ck.names(role="passthrough")
            if layer_prefix(name) not in self.mtp_layers
        }

    def quantized_linears(self) -> QuantizedLinears:
        """What the export quantizes, as its configs name it."""
        _, unquantized = self.linear_sets()
        return QuantizedLinears(
            self.ck.source_config,
            {self.hf_module(m): self.scales.format(m) for m in self.scales.formats},
            {name[: -len(".weight")]: self.format_of(name) for name in self.hf_weights()},
            frozenset(unquantized),
            frozenset(self.hf_module(m) for m in self.stacked_modules() - set(self.quantized)),
            frozenset(self.passthrough_prefixes()),
            self.recipe.kv_cache,
        )

    def ct_config(self) -> dict:
        """config.json with compressed-tensors' quantization_config (eprt.hf.quant_configs)."""
        return ct_config(self.quantized_linears())

    def configs(self) -> tuple[dict, dict]:
        """(config.json, hf_quant_config.json), as ModelOpt writes them (eprt.hf.quant_configs)."""
        return modelopt_configs(self.quantized_linears())


def experts_module(spec: TensorSpec) -> str:
    """The module stacked experts `spec` are exported under: the `P` of their per-expert sources
    `P.E.w1.weight` (DeepSeek-V4's release `layers.3.ffn.experts`, which eprt names
    `model.layers.3.ffn.experts`), as the engines and quantized_layers name a layer's experts."""
    return spec.sources[0].rpartition(".0.")[0]


def holding_layout(formats: list[str]) -> str:
    """The layout an export of `formats` is written in where none is asked for: ModelOpt's, the one
    every engine reads, unless a format has none there (INT4, W4A8, MXFP4): then compressed-tensors'."""
    return "modelopt" if all(weight_format(f).modelopt_layout for f in formats) else ct.NAME


def refuse_modelopt_layout(formats: dict[str, str], where: str) -> None:
    """Refuse, before any output, a ModelOpt-layout export of a module whose format has none (INT4,
    MXFP4: docs/export.md says why for each)."""
    for module, name in formats.items():
        fmt = weight_format(name)
        if not fmt.modelopt_layout:
            raise ConfigError(
                f"{where}: {module} is quantized with {fmt.name} ({fmt.quant_algo}), which the ModelOpt layout "
                "does not hold (ModelOpt's export has no algorithm for it that engines read): export it with "
                "--format compressed-tensors"
            )


def layer_prefix(name: str) -> str:
    """The layer a name is under (`model.layers.61` of `model.layers.61.eh_proj.weight`, DeepSeek-V4's
    MTP layer `mtp.0` of `mtp.0.e_proj.weight`), else the name."""
    return re.sub(r"((?:^|\.)(?:layers|mtp)\.\d+)\..*", r"\1", name)


def carried(name: str, quantized: set[str]) -> str:
    """The shortest dotted prefix P of a carried tensor that holds no quantized module:
    `vision_tower`, or `model.visual` beside a quantized `model.language_model`."""
    cuts = [i for i, c in enumerate(name) if c == "."]
    return next((name[:i] for i in cuts if not any(q.startswith(name[: i + 1]) for q in quantized)), name)
