"""GPT-OSS (`gpt_oss`: gpt-oss-20b and gpt-oss-120b). Config: config.py; tensors: layout.py; model:
model.py; the release's MXFP4 experts are an encoding (eprt.storage.mxfp4_blocks)."""

from __future__ import annotations

from eprt.families.family import COMMON_UNQUANTIZED, Family
from eprt.families.gpt_oss import config, layout, model

FAMILY = Family(
    config.FAMILY,
    (config.FAMILY,),
    config.parse,
    layout.layout,
    model.GptOssForCausalLM,
    # vLLM builds the router as a ReplicatedLinear without a quantization config
    unquantized=(*COMMON_UNQUANTIZED, r".*\.mlp\.router"),
)
