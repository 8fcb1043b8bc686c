"""The weight formats, by the name a recipe gives them (`format: nvfp4`): each one module of this
package holding one `WeightFormat` (eprt.quant.formats.base), the one place that knows it.
Adding a format is adding its module and its line here (docs/adding-a-format.md). The KV-cache
formats are a registry of their own (eprt.quant.formats.kv): a recipe names them apart
(`kv_cache:`), and they quantize cached keys and values, not weights.
"""

from __future__ import annotations

from typing import Iterable

from eprt.quant.formats.base import WeightFormat
from eprt.quant.formats.fp8 import FP8
from eprt.quant.formats.fp8_block import FP8_BLOCK
from eprt.quant.formats.fp8_channel import FP8_CHANNEL
from eprt.quant.formats.int4 import INT4, INT4_FULL, INT4_G32, INT4_G32_FULL
from eprt.quant.formats.mxfp4 import MXFP4
from eprt.quant.formats.mxfp8 import MXFP8
from eprt.quant.formats.nvfp4 import NVFP4
from eprt.quant.formats.nvfp4_a16 import NVFP4_A16
from eprt.quant.formats.nvfp4_input_scale1 import NVFP4_INPUT_SCALE1
from eprt.quant.formats.w4a8 import W4A8, W4A8_FULL

WEIGHT_FORMATS: dict[str, WeightFormat] = {
    f.name: f
    for f in (
        *(FP8, NVFP4, FP8_BLOCK, FP8_CHANNEL, NVFP4_A16, INT4, INT4_G32, W4A8, MXFP8, MXFP4, NVFP4_INPUT_SCALE1),
        *(INT4_FULL, INT4_G32_FULL, W4A8_FULL),
    )
}


def weight_format(name: str) -> WeightFormat:
    """The format a recipe names `name` (the recipe loader has refused any other)."""
    return WEIGHT_FORMATS[name]


def with_group_size(name: str, group_size: int) -> WeightFormat | None:
    """Format `name` in groups of `group_size` along the input dim (a recipe rule's `group_size:`): itself
    where those are its groups, else the registered format of the same kind in such groups (`int4` in
    groups of 32 is `int4_g32`), else None."""
    fmt = WEIGHT_FORMATS[name]
    return next((f for f in WEIGHT_FORMATS.values() if f.group_size == group_size and f.kind == fmt.kind), None)


def group_sizes(name: str) -> list[int]:
    """The groups format `name` comes in (a rule's `group_size:` choices): its own and its kind's."""
    fmt = WEIGHT_FORMATS[name]
    return sorted({f.group_size for f in WEIGHT_FORMATS.values() if f.kind == fmt.kind and f.group_size})


def with_grid(name: str, grid: str) -> WeightFormat | None:
    """Format `name` on INT4 grid `grid` (a rule's `grid:`, eprt.quant.formats.int4.GRIDS), in the
    same groups: itself where that is its grid, else None where it has no such grid."""
    fmt = WEIGHT_FORMATS[name]
    return next(
        (
            f
            for f in WEIGHT_FORMATS.values()
            if type(f) is type(fmt)
            and f.group_size == fmt.group_size
            and getattr(f, "grid", None)
            and f.grid.name == grid
        ),
        None,
    )


def by_quant_algo(quant_algo) -> WeightFormat | None:
    """The format ModelOpt's configs call `quant_algo`, or None for one eprt does not write in that layout."""
    return next((f for f in WEIGHT_FORMATS.values() if f.quant_algo == quant_algo and f.modelopt_layout), None)


def by_modelopt_weight_dtype(
    dtype: str,
    scale_rank: int | None = None,
    among: Iterable[WeightFormat] | None = None,
    scale_dtype: str | None = None,
) -> WeightFormat | None:
    """The format (of `among`, default all) whose ModelOpt weight is stored in safetensors dtype
    `dtype` (F8_E4M3, U8), or None; of several that store the same dtype (FP8, FP8 per channel, FP8
    block, MXFP8), the one whose `weight_scale` has rank `scale_rank` (0-dim per tensor, [out], a 2-D
    grid) and safetensors dtype `scale_dtype` (FP8 block's F32 grid, MXFP8's U8 one), else the
    first of that rank, else the first."""
    candidates = [
        f
        for f in (WEIGHT_FORMATS.values() if among is None else among)
        if f.modelopt_layout and f.modelopt_weight_dtype == dtype
    ]
    ranked = [f for f in candidates if f.modelopt_scale_rank == scale_rank]
    return next((f for f in ranked if f.modelopt_scale_dtype == scale_dtype), next(iter(ranked or candidates), None))


def by_ct_format(
    ct_format, strategy: str | None = None, inputs: bool = True, group_size: int | None = None
) -> WeightFormat | None:
    """The format compressed-tensors calls `ct_format` (float-quantized, ...), or None; of several of
    one `format` (FP8, FP8 block, FP8 per channel; NVFP4 and NVFP4 weights only; INT4 in groups of
    128 or 32, W4A8), the one whose weights' `strategy` (tensor, block, channel, group) it is, that
    quantizes `inputs` or not and whose groups are `group_size`, else such a one in other groups,
    else the first."""
    candidates = [f for f in WEIGHT_FORMATS.values() if f.ct_format == ct_format]
    fitting = [f for f in candidates if f.ct_strategy == strategy and (f.modelopt_input_group() is not None) == inputs]
    return next((f for f in fitting if f.group_size == group_size), next(iter(fitting), next(iter(candidates), None)))


def by_ct_weight(leaves: set[str], header_of, prefer: WeightFormat | None = None) -> WeightFormat | None:
    """The format a compressed-tensors Linear is stored in, by its leaves (`header_of(leaf)`: its
    safetensors dtype and shape), or None: a format's own stored-weight leaf (weight_packed) names
    it, a `weight` only by its dtype (a float one is unquantized). Of several that store the same
    (FP8, FP8 block, FP8 per channel; NVFP4 and NVFP4 weights only), in this order: `prefer` (the
    format the config declares) where its first scale has the shape it declares for the weight
    (FP8's [1], a block grid, a column of row scales), so that a missing scale is named as such; one
    whose first scale has that shape and whose leaves are all there (NVFP4's input_global_scale);
    one whose first scale has the shape; `prefer` (a misshapen scale is named as such); the first."""
    candidates = [
        f
        for f in sorted(WEIGHT_FORMATS.values(), key=lambda f: f.ct_weight_leaf == "weight")
        if f.ct_weight_leaf in leaves
        and (f.ct_weight_leaf != "weight" or header_of("weight")[0] == f.ct_leaves["weight"])
    ]

    def scale_fits(f: WeightFormat) -> bool:
        out, stored = header_of(f.ct_weight_leaf)[1] if len(header_of(f.ct_weight_leaf)[1]) == 2 else (0, 0)
        leaf, (_, shape) = list(f.compressed_tensors_tensors(out, f.in_dim_of_stored(stored)).items())[1]
        return leaf in leaves and tuple(header_of(leaf)[1]) == tuple(shape)

    # sorted is stable: the registry's order decides among equals
    ranked = sorted(
        candidates,
        key=lambda f: (
            not (f is prefer and scale_fits(f)),
            not (scale_fits(f) and set(f.ct_leaves) <= leaves),
            not scale_fits(f),
            f is not prefer,
        ),
    )
    return next(iter(ranked), None)
