"""Qwen3-Next (`qwen3_next`): Gated DeltaNet between gated full-attention layers; softmax-routed
experts plus a sigmoid-gated shared expert."""

from eprt.families.family import COMMON_UNQUANTIZED, Family
from eprt.families.qwen3_next import config, layout, model

FAMILY = Family(
    "qwen3_next",
    ("qwen3_next",),
    config.parse,
    layout.layout,
    model.Qwen3NextForCausalLM,
    # vLLM builds these without quantization: the shared expert's gate (one output) and the linear
    # attention's b/a projections (merged into in_proj_ba, quant_config=None); conv1d is no Linear.
    unquantized=(*COMMON_UNQUANTIZED, r".*\.mlp\.shared_expert_gate", r".*\.linear_attn\.in_proj_(ba|b|a)"),
)
