"""MLA's kv_b_proj, which vLLM 0.32 absorbs into the attention at load time by running it on an
identity matrix (DeepSeek-V3, Kimi-K2/K3 and Kimi-Linear's MLA layers). In a format that quantizes
its inputs to 4 bits (NVFP4 W4A4) the identity's 1.0s are quantized too, and every absorbed weight
comes out scaled (eprt.hf.check_engine_quirks measures by how much and warns of it in an export).
The shipped recipes keep kv_b_proj out of such formats, and the format search never offers one
for it."""

from __future__ import annotations

from eprt.quant.formats import WeightFormat

ABSORBED = ".self_attn.kv_b_proj"  # the MLA projection vLLM absorbs through an identity matrix


def quantizes_inputs_to_4_bits(fmt: WeightFormat) -> bool:
    inputs = fmt.modelopt_input_group()
    return inputs is not None and inputs["num_bits"] == 4


def absorbed_in_4_bit_inputs(module: str, fmt: WeightFormat) -> bool:
    """Whether vLLM's absorption of `module` would quantize its identity matrix under `fmt`."""
    return module.endswith(ABSORBED) and quantizes_inputs_to_4_bits(fmt)
