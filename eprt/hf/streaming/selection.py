"""Which tensors of a checkpoint the model-free export quantizes, and under which names.

A quantizable tensor is a 2-D floating `M.weight` (a Linear's, module M) or a 3-D stack of routed
experts, `P.experts.gate_up_proj` [E, 2I, D] (each expert's gate rows, then its up rows),
`P.experts.gate_proj` / `up_proj` [E, I, D] or `P.experts.down_proj` [E, D, I], as transformers 5
holds them (with or without a `.weight` leaf), or transposed, [E, in, out], as transformers' GPT-OSS
and Llama-4 hold them (`Stacks`). A stacked tensor is written expert by expert, [out, in], as the
engines load quantized experts: `P.experts.{e}.gate_proj.weight` and so on, and so are the biases of
a quantized stack (`P.experts.gate_up_proj_bias` [E, 2I] as `P.experts.{e}.gate_proj.bias`, ...).

A recipe's rules match module names as for a family eprt models: a routed expert's projection
`P.experts.7.up_proj` is matched as its experts module `P.experts`, every other Linear by its own
name. What is never quantized is, for a model eprt does not model, `DEFAULT_IGNORE` (embeddings,
heads, norms, routers and gates, convolutions, SSM and sink parameters, a vision tower: most are
not 2-D Linear weights anyway), or the recipe's own `ignore:` list in its place; for a family eprt
models, its own table decides (eprt.quant.feasibility.quantized_modules: the family's unquantized
modules; the recipe's `ignore:` besides), so the export is the modeled one's. The
multi-token-prediction layers are carried whole unless the recipe says `mtp: true` (`mtp_layer`).
"""

from __future__ import annotations

import fnmatch
import re
from collections import defaultdict
from dataclasses import dataclass

from eprt.errors import ConfigError
from eprt.hf.expert_stacks import STACKED, STACKED_BIAS, orders, pieces_of
from eprt.layout import TensorSpec
from eprt.quant.recipe import ExpertsStorage, Recipe

# module globs the model-free export leaves alone unless a recipe's `ignore:` replaces them
DEFAULT_IGNORE = (
    "*embed*",  # token and position embeddings
    "lm_head",
    "*.lm_head",
    "*norm*",  # every norm's weight
    "*.gate",  # MoE routers: mlp.gate, block_sparse_moe.gate
    "*.gate.*",  # a router's own Linear (Hunyuan's mlp.gate.wg)
    "*router*",
    "*shared_expert_gate",
    "*conv*",  # convolutions (Mamba's, a vision stem's)
    "*A_log*",  # SSM parameters
    "*dt_proj*",
    "*sinks*",  # attention sinks
    "*vision*",  # a vision tower and its projector, which the language model's recipes leave alone
    "*visual*",
    "*mm_projector*",
    "*multi_modal_projector*",
)

# The multi-token-prediction layers of a model eprt does not model, by name: DeepSeek-V3's and
# GLM-4.5's decoder layers past `num_hidden_layers` (`model.layers.61`), the layers under an `mtp`
# module (Qwen3-Next's `mtp.layers.0`) and MiMo's `model.mtp_layers.0`. A recipe without `mtp: true` carries them whole, as a
# modeled family's table does; one with it quantizes them by its rules, but for the modules an
# MTP layer has of its own, which the engines build unquantized (its input projection, shared head).
MTP_PREFIX = re.compile(r"(?P<layer>(?:.*\.)?mtp(?:_layers\.\d+)?)\.")
TEXT_LAYER = re.compile(r"(?P<layer>(?:.*\.)?(?:model|language_model)\.layers\.(?P<n>\d+))\.")
MTP_OWN = ("*.eh_proj", "*.shared_head.*", "*mtp.fc")

# A routed expert's projections that the engines fuse into one weight: they share NVFP4's
# per-tensor scale, as gate and up of one row of a family's first stacked projection do.
EXPERT_SIBLINGS = ({"gate_proj", "up_proj"}, {"w1", "w3"})
EXPERT_LINEAR = re.compile(r"(?P<experts>.+\.experts)\.(?P<e>\d+)\.(?P<proj>[^.]+)")


@dataclass(frozen=True)
class Linear:
    """One Linear the export writes quantized."""

    name: str  # its module name in the export (a routed expert's projection one by one)
    module: str  # the module the recipe's rules name (a layer's routed experts: `...experts`)
    source: str  # the source tensor holding its weight
    index: int | None  # its expert's entry along dim 0 of a stacked source; None: the whole tensor
    rows: tuple[int, int] | None  # its rows of that entry (gate or up of gate_up_proj); None: all
    shape: tuple[int, int]  # [out, in]
    group: tuple  # the Linears sharing a per-tensor weight scale (where the format has one) have one group


def recipe_module(name: str) -> str:
    """The module a recipe's rules match for Linear `name`: a routed expert's, its experts module."""
    m = EXPERT_LINEAR.fullmatch(name)
    return m["experts"] if m else name


def mtp_layer(name: str, num_layers: int | None) -> str | None:
    """The multi-token-prediction layer tensor `name` belongs to (its module prefix), or None."""
    m = MTP_PREFIX.match(name)
    if m:
        return m["layer"]
    m = TEXT_LAYER.match(name)
    return m["layer"] if m and num_layers is not None and int(m["n"]) >= num_layers else None


def mtp_own(module: str) -> bool:
    return any(fnmatch.fnmatchcase(module, p) for p in MTP_OWN)


def ignored(module: str, recipe: Recipe) -> bool:
    patterns = recipe.ignore if recipe.ignore is not None else DEFAULT_IGNORE
    return any(fnmatch.fnmatchcase(module, p) for p in patterns)


def expert_group(name: str) -> tuple:
    """The scale group of Linear `name`: a routed expert's projection's is its expert's fused
    siblings (or itself alone), as a row of a family's stacked projections; any other's ("linear") is
    settled by the engines' fusion of dense Linears (eprt.hf.streaming.plan.scale_groups)."""
    m = EXPERT_LINEAR.fullmatch(name)
    if m is None:
        return ("linear", name)
    siblings = next((g for g in EXPERT_SIBLINGS if m["proj"] in g), {m["proj"]})
    return ("expert", m["experts"], int(m["e"]), min(siblings))


class Stacks:
    """The 3-D stacks of routed experts of a checkpoint eprt does not model, and how each layer's are
    stored. A layer's stacks (one `...experts` module's) share one order, which their shapes tell
    against `hidden_size` together: GPT-OSS-120B's square down_proj [E, 2880, 2880] takes the order of
    its gate_up_proj [E, 2880, 5760]. Where every stack of a layer is square the shapes cannot tell,
    and the recipe's `experts_storage: {transposed: ...}` must; it also says whether a fused
    gate_up_proj interleaves gate and up (default: gate, then up)."""

    def __init__(
        self, shapes: dict[str, tuple[int, ...]], hidden: int | None, storage: ExpertsStorage | None, where: str
    ):
        self.hidden, self.where = hidden, where
        self.storage = storage or ExpertsStorage()
        self.fits: dict[str, set[bool]] = defaultdict(lambda: {False, True})
        self.names: dict[str, list[str]] = defaultdict(list)
        for name, shape in shapes.items():
            m = STACKED.fullmatch(name)
            if m is not None and len(shape) == 3:
                self.fits[m["experts"]] &= orders(m["proj"], shape, hidden) if hidden is not None else set()
                self.names[m["experts"]].append(f"{name} {list(shape)}")

    def transposed(self, experts: str) -> bool:
        """Whether the stacks of `experts` are stored [E, in, out]; refused where no order or both fit."""
        fits, said = self.fits[experts], self.storage.transposed
        stacks = ", ".join(self.names[experts])
        if said is not None and said in fits:
            return said
        if said is None and len(fits) == 1:
            return next(iter(fits))
        if said is None and fits:
            raise ConfigError(
                f"{self.where}: the stacks of {experts} ({stacks}) are square, so their shapes cannot tell "
                "[experts, out, in] from [experts, in, out]: say which in the recipe, experts_storage: "
                "{transposed: true} (transformers' GPT-OSS and Llama-4) or {transposed: false}"
            )
        told = f", as the recipe's experts_storage says (transposed: {said})" if said is not None else ""
        raise ConfigError(
            f"{self.where}: the stacks of {experts} ({stacks}) are not stacks of experts as [experts, out, in] "
            f"nor [experts, in, out] with hidden_size {self.hidden}{told}: leave them unquantized with the "
            "recipe's ignore list, or convert the checkpoint first"
        )

    def order(self, name: str, shape: tuple[int, ...], proj: str, transposed: bool) -> TensorSpec:
        """Stack `name` as a spec whose `from_fused` reads it [E, out, in], its pieces apart."""
        interleaved = len(pieces_of(proj)) if self.storage.interleaved else 1
        eprt_shape = (shape[0], shape[2], shape[1]) if transposed else tuple(shape)
        return TensorSpec(name, eprt_shape, (name,), transposed=transposed, interleaved=interleaved)

    def linears(self, name: str, shape: tuple[int, ...]) -> tuple[list[Linear], TensorSpec]:
        """The per-expert Linears of stack `name` of `shape`, and its order (`order`)."""
        m = STACKED.fullmatch(name)
        experts, pieces = m["experts"], pieces_of(m["proj"])
        spec = self.order(name, shape, m["proj"], self.transposed(experts))
        num, out_dim, in_dim = spec.shape
        h = out_dim // len(pieces)
        linears = [
            Linear(
                f"{experts}.{e}.{piece}",
                experts,
                name,
                e,
                (k * h, (k + 1) * h) if len(pieces) > 1 else None,
                (h, in_dim),
                expert_group(f"{experts}.{e}.{piece}"),
            )
            for e in range(num)
            for k, piece in enumerate(pieces)
        ]
        return linears, spec

    def biases(self, name: str, shape: tuple[int, ...]) -> tuple[list[tuple[str, int, tuple[int, int]]], TensorSpec]:
        """Stack `name`'s biases [E, out] expert by expert, each projection's apart: (name, expert, rows)
        of each, and the order they are read in (gate and up interleaved as the weights are)."""
        m = STACKED_BIAS.fullmatch(name)
        pieces = pieces_of(m["proj"])
        spec = self.order(name, shape, m["proj"], False)
        h = shape[1] // len(pieces)
        out = [
            (f"{m['experts']}.{e}.{piece}.bias", e, (k * h, (k + 1) * h))
            for e in range(shape[0])
            for k, piece in enumerate(pieces)
        ]
        return out, spec


def weight_linear(name: str, shape: tuple[int, ...]) -> Linear | None:
    """The Linear of a 2-D `M.weight`, or None for any other tensor."""
    if not name.endswith(".weight") or len(shape) != 2:
        return None
    module = name[: -len(".weight")]
    return Linear(module, recipe_module(module), name, None, None, tuple(shape), expert_group(module))
