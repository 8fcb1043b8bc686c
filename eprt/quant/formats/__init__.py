"""The weight formats, by the name a recipe gives them (`format: nvfp4`): each one module of this
package holding one `WeightFormat` (eprt.quant.formats.base), the one place that knows it.
Adding a format is adding its module and its line here (docs/adding-a-format.md). The KV-cache
formats are a registry of their own (eprt.quant.formats.kv): a recipe names them apart
(`kv_cache:`), and they quantize cached keys and values, not weights.
"""

from __future__ import annotations

from eprt.quant.formats.base import WeightFormat
from eprt.quant.formats.fp8 import FP8
from eprt.quant.formats.nvfp4 import NVFP4

WEIGHT_FORMATS: dict[str, WeightFormat] = {f.name: f for f in (FP8, NVFP4)}


def weight_format(name: str) -> WeightFormat:
    """The format a recipe names `name` (the recipe loader has refused any other)."""
    return WEIGHT_FORMATS[name]


def by_quant_algo(quant_algo) -> WeightFormat | None:
    """The format ModelOpt's configs call `quant_algo`, or None for one eprt does not write."""
    return next((f for f in WEIGHT_FORMATS.values() if f.quant_algo == quant_algo), None)


def by_modelopt_weight_dtype(dtype: str) -> WeightFormat | None:
    """The format whose ModelOpt weight is stored in safetensors dtype `dtype` (F8_E4M3, U8), or None."""
    return next((f for f in WEIGHT_FORMATS.values() if f.modelopt_weight_dtype == dtype), None)


def by_ct_format(ct_format) -> WeightFormat | None:
    """The format compressed-tensors calls `ct_format` (float-quantized, ...), or None."""
    return next((f for f in WEIGHT_FORMATS.values() if f.ct_format == ct_format), None)
