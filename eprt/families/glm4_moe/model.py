"""GLM-4.5 / GLM-4.6: grouped-query attention (partial rotate-half RoPE, optional q/k norm,
q/k/v biases) under DeepSeek-V3's MLPs (the first layers dense, then sigmoid noaux_tc experts
plus shared experts)."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.families.deepseek_v3.model import deepseek_mlp
from eprt.models.attention import GQAttention
from eprt.models.decoder import CausalLM, DecoderLayer, attention_then_mlp


class Glm4MoeForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(
            c,
            [
                DecoderLayer(*attention_then_mlp(c, GQAttention(c), deepseek_mlp(c, i, expert_range)))
                for i in range(c.num_layers)
            ],
        )
