"""DeepSeek-V3.2: DeepSeek-V3 whose MLA attends, for each query, only to the keys the lightning
indexer picks (DeepSeek Sparse Attention); the MoE and the dense first layers as DeepSeek-V3's."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.families.deepseek_v3.model import deepseek_mlp
from eprt.models.decoder import CausalLM, DecoderLayer, attention_then_mlp
from eprt.models.dsa import Indexer
from eprt.models.mla import MLAttention


class DeepseekV32ForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(
            c,
            [
                DecoderLayer(
                    *attention_then_mlp(c, MLAttention(c, indexer=Indexer(c)), deepseek_mlp(c, i, expert_range))
                )
                for i in range(c.num_layers)
            ],
        )
