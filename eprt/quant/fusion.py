"""Which quantized Linears must share scales because the engines fuse them.

vLLM and SGLang fuse Linears that read the same input (q/k/v into qkv_proj, gate/up into
gate_up_proj, DeepSeek's q_a_proj and kv_a_proj_with_mqa into fused_qkv_a_proj) and give the
fused weight, in a format that says so (`shares_fused_scales`: NVFP4), one per-tensor weight scale
(weight_scale_2) and one input_scale: the members must agree, or the engine mis-scales all but one
of them. FP8 per-tensor keeps separate scales (vLLM requantizes). FP8 block and FP8 per channel
have no per-tensor scale and scale inputs at run time: each member keeps its own block or row
scales, which the engines stack into the fused weight's, so they share nothing.

`FUSED_ON_LOAD` is the one table of what the engines fuse: the calibration (`siblings`), the
recipe's checks (eprt.quant.feasibility), auto_quantize's groups and the export checkers
(eprt.hf.check_modelopt, eprt.hf.check_compressed_tensors) all read it.
"""

from __future__ import annotations

from eprt.quant.formats import WeightFormat

# The Linears vLLM and SGLang load as one fused Linear, by leaf name: the fused module -> its
# members, in the fused weight's output order (vLLM's packed_modules_mapping).
FUSED_ON_LOAD = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "fused_qkv_a_proj": ("q_a_proj", "kv_a_proj_with_mqa"),
    "w13": ("w1", "w3"),  # DeepSeek-V4's shared expert, its gate and up under DeepSeek's names
    "fused_wqa_wkv": ("wq_a", "wkv"),  # DeepSeek-V4's attention: q's down-projection and the one KV head
}
# Linears that read one input and share input_scale and the per-tensor weight scale in a format
# that shares them (NVFP4's weight_scale_2): the fused ones, among them gate/up of a routed expert as an
# export names them apart (gate_proj/up_proj, or w1/w3), which the fused MoE loads as one gate/up weight
# with gate's weight scale.
SAME_INPUT = tuple(FUSED_ON_LOAD.values())


def fused_members(leaf: str) -> tuple[str, ...]:
    """The leaves loaded fused with `leaf` (itself included), or () where it is loaded alone."""
    return next((g for g in FUSED_ON_LOAD.values() if leaf in g), ())


def siblings(module: str, quantized, fmt: WeightFormat) -> list[str]:
    """The quantized modules that share `module`'s input amax and per-tensor weight amax (itself
    included), `module` quantized in `fmt`."""
    if not fmt.shares_fused_scales:
        return [module]
    parent, leaf = module.rsplit(".", 1)
    group = fused_members(leaf) or (leaf,)
    return [f"{parent}.{x}" for x in sorted(group) if f"{parent}.{x}" in quantized] or [module]
