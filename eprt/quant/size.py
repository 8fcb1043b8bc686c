"""The size a recipe gives a model's Linear weights: what the quality report says beside its numbers.

Counted over the decoder layers' Linear weights (the multi-token-prediction layers, embeddings,
head and norms aside, as the format search counts them): their parameters, their bytes
unquantized (bf16) and as the export stores them in the recipe's formats (scales included), and
bits per parameter, over all parameters and over those a token activates (a routed expert's
weighted by top-k / experts).
"""

from __future__ import annotations

from eprt.layout import Layout
from eprt.quant.algorithms.search.auto_quantize import linear_bits, linear_weights
from eprt.quant.algorithms.search.budget import UNQUANTIZED_BITS
from eprt.quant.recipe import Recipe


def recipe_size(layout: Layout, recipe: Recipe, top_k: int, num_experts: int) -> dict:
    """What `recipe` makes of `layout`'s decoder Linear weights (above)."""
    params = active = bits = active_bits = 0.0
    for module in layout.linear_modules():
        fmt = recipe.format_of(module) or "none"
        for n, out_dim, in_dim, share in linear_weights(layout, module, top_k, num_experts):
            b = n * linear_bits(fmt, out_dim, in_dim)
            params, bits = params + n * out_dim * in_dim, bits + b
            active, active_bits = active + n * out_dim * in_dim * share, active_bits + b * share
    return {
        "linear_parameters": int(params),
        "bytes_unquantized": int(params * UNQUANTIZED_BITS // 8),
        "bytes_quantized": int(bits // 8),
        "bits_per_parameter": bits / params if params else 0.0,
        "bits_per_active_parameter": active_bits / active if active else 0.0,
    }
