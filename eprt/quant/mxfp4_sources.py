"""Routed experts a source stores in MXFP4 (Kimi-K3's compressed-tensors MXFP4, GPT-OSS's OpenAI MXFP4,
DeepSeek-V4's FP4: the same E2M1 codes and E8M0 scale per 32 under other names) that a recipe quantizes to a format keeping
such weights exactly where it can (NVFP4: eprt.quant.formats.nvfp4, 'MXFP4 weights in NVFP4'): how
many of their blocks of 32 it keeps, counted from the source's own E8M0 scales, which the checkpoint
holds as the source stored them, so no weight is decoded and every layout counts the same.
"""

from __future__ import annotations

from typing import Mapping

from eprt.layout import Layout
from eprt.quant.formats import weight_format
from eprt.storage.checkpoint import Checkpoint
from eprt.storage.deepseek_encodings import e8m0_exponents
from eprt.storage.encodings import CT_PREFIX, DEEPSEEK_FP4
from eprt.storage.mxfp4_blocks import MXFP4_BLOCKS

MXFP4 = CT_PREFIX + "mxfp4-pack-quantized"  # the encoding of a tensor the source stores in MXFP4
# the encodings of MXFP4 blocks, each with the component holding their E8M0 scales
MXFP4_SCALES = {MXFP4: "weight_scale", MXFP4_BLOCKS: "scales", DEEPSEEK_FP4: "scale"}


def mxfp4_blocks_kept(ck: Checkpoint, layout: Layout, formats: Mapping[str, str | None]) -> dict | None:
    """{"experts_tensors", "blocks", "kept"} over the stacked routed experts stored in MXFP4 whose
    module `formats` gives a format that keeps them; None where there are none."""
    tensors = blocks = kept = 0
    for spec in layout.specs:
        fmt = formats.get(spec.name.rsplit(".", 1)[0])
        if not spec.stacked or fmt is None or spec.name not in ck.tensors:
            continue
        scales = MXFP4_SCALES.get(ck.meta(spec.name).encoding)
        if scales is None:
            continue
        counts = weight_format(fmt).mxfp4_blocks_kept(e8m0_exponents(ck.read_component(spec.name, scales)))
        if counts is not None:
            tensors, blocks, kept = tensors + 1, blocks + counts[0], kept + counts[1]
    return {"experts_tensors": tensors, "blocks": blocks, "kept": kept} if tensors else None
