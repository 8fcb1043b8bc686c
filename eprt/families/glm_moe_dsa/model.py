"""GLM-5: DeepSeek-V3.2's decoder whose indexer rotates interleaved, and whose layers marked
"shared" run no indexer of their own: each attends to the keys the last layer that ran one picked.
Where a layer shares, every layer's attention takes the layer context's `carried`
(eprt.models.decoder.LayerContext): a full layer leaves its pick there, a shared layer reads it. Layer 0 is full (the config reader
refuses a file that marks it shared), so a shared layer finds a pick in every run of the layers in
order; the layer-by-layer run carries it per sequence (eprt.quant.loop.sequences.LayerState)."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.families.deepseek_v3.model import deepseek_mlp
from eprt.models.decoder import CausalLM, DecoderLayer, attention_then_mlp
from eprt.models.dsa import Indexer
from eprt.models.mla import MLAttention


def glm_moe_dsa_layer(c: ModelConfig, i: int, expert_range: tuple[int, int] | None) -> DecoderLayer:
    indexer = None if c.own.shares_index(i) else Indexer(c, interleaved_rope=True)
    attention = MLAttention(c, indexer=indexer)
    # the attention reads and leaves the pick in the layer context where a layer shares it
    carries = bool(c.own.shared_index_layers)
    return DecoderLayer(*attention_then_mlp(c, attention, deepseek_mlp(c, i, expert_range), carries=carries))


class GlmMoeDsaForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(c, [glm_moe_dsa_layer(c, i, expert_range) for i in range(c.num_layers)])
