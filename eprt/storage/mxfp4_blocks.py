"""OpenAI's MXFP4 (`quant_method: mxfp4` in config.json, GPT-OSS's release): a weight P stored as
`P_blocks` uint8 [..., out, in/32, 16] and `P_scales` uint8 [..., out, in/32]. Each byte of a block
holds two E2M1 codes, the even element in the low nibble; each block of 32 elements along the input
dim has one E8M0 scale (exponent e: 2^(e - 127)). A weight decodes to code value times scale, exact
in bf16 (what transformers' Mxfp4 dequantization gives); its rows are its outputs, whatever order
the model's other form of the weight (GPT-OSS's bf16 experts: [E, in, out]) stores them in.
"""

from __future__ import annotations

import torch

from eprt.errors import CheckpointError

MXFP4_BLOCKS = "mxfp4"  # the encoding, and the manifest's name of its quantization_config
BLOCK = 32  # elements per scale
# GPT-OSS's release: what it keeps unquantized (attention, router, embedding, head), by vLLM's patterns
RELEASE_QUANTIZATION_CONFIG = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": MXFP4_BLOCKS,
}
# E2M1 code -> value: bit 3 the sign, bits 0-2 the magnitude's index (OCP MX; the release's FP4_VALUES)
_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_TABLE = torch.tensor(_MAGNITUDES + tuple(-v for v in _MAGNITUDES), dtype=torch.float32)
DECODED = torch.bfloat16


def decode_mxfp4_blocks(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = DECODED) -> torch.Tensor:
    """The weight [..., out, in] of `blocks` [..., out, in/32, 16] and `scales` [..., out, in/32]."""
    if (
        blocks.dtype != torch.uint8
        or scales.dtype != torch.uint8
        or blocks.shape[-1] != BLOCK // 2
        or tuple(blocks.shape[:-1]) != tuple(scales.shape)
    ):
        raise CheckpointError(
            f"MXFP4 blocks {blocks.dtype}{list(blocks.shape)} and scales {scales.dtype}{list(scales.shape)} "
            f"are not uint8 [..., out, in/{BLOCK}, {BLOCK // 2}] and uint8 [..., out, in/{BLOCK}]"
        )
    table = E2M1_TABLE.to(blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., out, in/32, 32]
    values = table[codes] * torch.exp2(scales.float() - 127.0)[..., None]
    return values.flatten(-2).to(dtype)


class MxFp4Blocks:
    """The decoder of `quant_method: mxfp4` weights (eprt.storage.encodings.decoder)."""

    components = ("blocks", "scales")
    batched = True  # weights stacked along leading dims (fused experts) decode in one call
    on_device = True  # plain tensor arithmetic: decodes on the device its components are on

    def __init__(self, scheme: dict):
        self.scheme = scheme

    def decode(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return decode_mxfp4_blocks(c["blocks"], c["scales"])
