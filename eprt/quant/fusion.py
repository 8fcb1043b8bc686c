"""Which quantized Linears must share scales because the engines fuse them.

vLLM and SGLang fuse Linears that read the same input (q/k/v into qkv_proj, gate/up into
gate_up_proj, DeepSeek's q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj) and give the
fused weight, in a format that says so (`shares_fused_scales`: NVFP4), one per-tensor weight scale
(weight_scale_2) and one input_scale: the members must agree, or the engine mis-scales all but one
of them. FP8 per-tensor keeps separate scales (vLLM requantizes). FP8 block and FP8 per channel
have no per-tensor scale and scale inputs at run time: each member keeps its own block or row
scales, which the engines stack into the fused weight's, so they share nothing.
"""

from __future__ import annotations

from eprt.quant.formats import WeightFormat

FUSED_SIBLINGS = ({"q_proj", "k_proj", "v_proj"}, {"gate_proj", "up_proj"}, {"q_a_proj", "kv_a_proj_with_mqa"})


def siblings(module: str, quantized, fmt: WeightFormat) -> list[str]:
    """The quantized modules that share `module`'s input amax and per-tensor weight amax (itself
    included), `module` quantized in `fmt`."""
    if not fmt.shares_fused_scales:
        return [module]
    parent, leaf = module.rsplit(".", 1)
    group = next((g for g in FUSED_SIBLINGS if leaf in g), {leaf})
    return [f"{parent}.{x}" for x in sorted(group) if f"{parent}.{x}" in quantized] or [module]
