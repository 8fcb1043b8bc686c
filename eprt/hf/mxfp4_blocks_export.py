"""The MXFP4 blocks layout of a quantized export (`--format mxfp4`): GPT-OSS's release layout
(`quant_method: mxfp4`, eprt.storage.mxfp4_blocks), the one layout of quantized GPT-OSS experts
that vLLM's GPT-OSS class loads as it loads the release (docs/export.md, 'GPT-OSS in the release's
MXFP4').

Each quantized stack of routed experts P is written fused, as the release stores it: `P_blocks`
uint8 [E, out, in/32, 16] and `P_scales` uint8 [E, out, in/32], the rows its outputs in the fused
tensor's order (gate and up interleaved, eprt.layout.TensorSpec.interleave), each row eprt's own
MXFP4 codes and E8M0 scales of the calibrated weight (eprt.quant.formats.mxfp4; GPTQ's codes where
it chose them). From an MXFP4 source (the release), a block the source's scale holds exactly keeps
that scale (`keeping_source_scales`): the same values, so the release calibrated with `max` comes
back byte for byte. The experts' biases fused as the source stores them; every other tensor in the
source's names and dtype. config.json carries the release's quantization_config.

Only what the release quantizes may be quantized: the routed experts, in MXFP4, with no KV-cache
scales (the layout has none). Anything else is refused before any output, with the recipe that fits.
"""

from __future__ import annotations

from typing import Callable

import torch

from eprt.errors import ConfigError
from eprt.hf.tensors import OutTensor
from eprt.layout import TensorSpec
from eprt.quant.formats.mxfp4 import dequantize_mxfp4, quantize_mxfp4
from eprt.storage.encodings import without_quantization
from eprt.storage.mxfp4_blocks import BLOCK, MXFP4_BLOCKS, RELEASE_QUANTIZATION_CONFIG

NAME = MXFP4_BLOCKS  # the layout's --format name: its config's quant_method
FAMILY = "gpt_oss"  # the model_type whose engines load this layout
RECIPE = "mxfp4_experts_only"  # the shipped recipe that quantizes what the layout holds


def refuse_unheld(
    model_type: str, formats: dict[str, str], experts: set[str], kv_cache: str | None, where: str
) -> None:
    """Refuse, before any output, an export in this layout of anything but GPT-OSS's routed experts
    (`experts`: the fused stacks' modules) in MXFP4 (`formats`: quantized module -> format name)."""
    way_out = f"calibrate with --recipe {RECIPE}, or export with --format compressed-tensors"
    if model_type != FAMILY:
        raise ConfigError(
            f"{where}: --format {NAME} is GPT-OSS's release layout, which the engines load for {FAMILY} only, "
            f"not for {model_type}; export with --format compressed-tensors or modelopt"
        )
    for module, fmt in sorted(formats.items()):
        if module not in experts or fmt != NAME:
            what = "a routed experts stack" if module in experts else "not a routed experts stack"
            raise ConfigError(
                f"{where}: {module} ({what}) is quantized with {fmt}, and --format {NAME} holds only the routed "
                f"experts in {NAME}, as the release stores them; {way_out}"
            )
    if kv_cache is not None:
        raise ConfigError(
            f"{where}: calibrated with --kv-cache {kv_cache}, and --format {NAME} has no KV-cache scales; "
            f"calibrate without --kv-cache, or export with --format compressed-tensors"
        )


def quantization_config(source_config: dict) -> dict:
    """config.json with the release's quantization_config: the source's own where it is the release
    (the same bytes), else the release's modules_to_not_convert."""
    own = source_config.get("quantization_config")
    quant = own if isinstance(own, dict) and own.get("quant_method") == NAME else RELEASE_QUANTIZATION_CONFIG
    return {**without_quantization(source_config), "quantization_config": quant}


def keeping_source_scales(row: dict[str, torch.Tensor], source_scales: torch.Tensor) -> dict[str, torch.Tensor]:
    """`row` (packed codes "weight" [out, in/2], E8M0 "weight_scale" [out, in/32]) with each block
    that the source's own scale (`source_scales`, the weight's MXFP4 source) holds exactly encoded
    under that scale: the same values in the source's bytes. A block whose largest code is 3 has two
    exact encodings (3 x s, or 6 x s/2); eprt's rule picks the finer, a release may store the other."""
    codes, scales = row["weight"], row["weight_scale"]
    values = dequantize_mxfp4(codes, scales)
    theirs = quantize_mxfp4(values, source_scales)
    blocks = (*scales.shape, BLOCK)
    same = (dequantize_mxfp4(theirs, source_scales) == values).view(blocks).all(-1)
    kept = torch.where(same[..., None], theirs.view(*scales.shape, -1), codes.view(*scales.shape, -1))
    return {**row, "weight": kept.view(codes.shape), "weight_scale": torch.where(same, source_scales, scales)}


def blocks_tensors(spec: TensorSpec, row: Callable[[int], dict[str, torch.Tensor]]) -> list[OutTensor]:
    """`P_blocks` and `P_scales` of the fused stack `spec` names, from `row(e)`: expert e's packed
    codes ("weight" [out, in/2]) and E8M0 scales ("weight_scale" [out, in/32]) in eprt's row order."""
    E, out_dim, in_dim = spec.shape
    blocks_shape, scales_shape = (E, out_dim, in_dim // BLOCK, BLOCK // 2), (E, out_dim, in_dim // BLOCK)

    kept: dict[str, torch.Tensor] = {}

    def part(leaf: str) -> torch.Tensor:
        """One of the two, both quantized in one pass over the experts, filled in place expert by
        expert (no second copy of the stack), and each handed out once."""
        if not kept:
            kept.update(weight=torch.empty(blocks_shape, dtype=torch.uint8))
            kept.update(weight_scale=torch.empty(scales_shape, dtype=torch.uint8))
            for e in range(E):
                for k, t in row(e).items():
                    if k in kept:  # the release's row order: gate and up alternating
                        kept[k][e] = spec.interleave(t.reshape(1, *kept[k].shape[1:]))[0]
        return kept.pop(leaf)

    return [
        OutTensor(f"{spec.fused}_blocks", torch.uint8, blocks_shape, lambda: part("weight")),
        OutTensor(f"{spec.fused}_scales", torch.uint8, scales_shape, lambda: part("weight_scale")),
    ]
