"""GLM-5 / 5.1 / 5.2 / 5.3 (`glm_moe_dsa`): DeepSeek-V3.2's model (MLA with the lightning indexer,
the sigmoid-routed MoE) with GLM's dims, the indexer's RoPE interleaved, and index sharing: a
layer marked "shared" runs no indexer and attends to the keys the last "full" layer before it
picked. The per-layer marks come as transformers 5.25 reads them: `indexer_types`, else
`index_topk_pattern` ("F"/"S" per layer), else the schedule `index_topk_freq` /
`index_skip_topk_offset` (every layer full when the file has none of them)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from eprt.config import FamilyConfig, ModelConfig, own_config
from eprt.config_fields import Fields
from eprt.families.deepseek_v32 import config as deepseek_v32

# transformers' GlmMoeDsaConfig defaults where they differ from DeepSeek-V3's, for a file that
# leaves a field out (the releases write every one)
GLM_DEFAULTS = {
    "index_n_heads": 32,
    "n_group": 1,
    "topk_group": 1,
    "q_lora_rank": 2048,
    "qk_nope_head_dim": 192,
    "v_head_dim": 256,
    "intermediate_size": 12288,
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 202752,
}
INDEXER_TYPES = ("full", "shared")
PATTERN_LETTERS = {"F": "full", "S": "shared"}


@own_config("glm_moe_dsa")
@dataclass(frozen=True)
class GlmMoeDsaConfig(FamilyConfig):
    shared_index_layers: tuple[int, ...]  # layers without an indexer, attending to the last full layer's keys

    def shares_index(self, layer: int) -> bool:
        return layer in self.shared_index_layers

    def carried_bytes(self, seq_len: int) -> int:
        """The keys the last full layer picked (bool [T, T]), where a layer shares them: three while
        a full layer leaves its own (the old, the new per sequence, joined)."""
        return 3 * seq_len * seq_len if self.shared_index_layers else 0


def parse(hf: dict, source: str) -> ModelConfig:
    c = deepseek_v32.parse({**GLM_DEFAULTS, **hf}, source)
    f = Fields(hf, source)
    if not f.get("indexer_rope_interleave", default=True):
        raise f.refuse(
            "indexer_rope_interleave is false; GLM-5's indexer rotates interleaved pairs (as transformers' "
            "reference does) and eprt runs only that"
        )
    shared = shared_index_layers(f, c.num_layers)
    return dataclasses.replace(c, family="glm_moe_dsa", own=GlmMoeDsaConfig(shared))


def shared_index_layers(f: Fields, n_layers: int) -> tuple[int, ...]:
    """The decoder layers marked "shared", as transformers derives the marks."""
    types = f.get("indexer_types", default=None)
    if types is None:
        pattern = f.get("index_topk_pattern", default=None)
        if pattern is not None:
            letters = list(pattern) if isinstance(pattern, str) else pattern
            types = [PATTERN_LETTERS.get(x, x) for x in f.layer_list("index_topk_pattern", letters)]
        else:
            freq = max(f.get("index_topk_freq", default=1), 1)
            offset = f.get("index_skip_topk_offset", default=2)
            types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n_layers)]
    # a longer list may mark the multi-token-prediction layers too; the decoder reads its own
    if not isinstance(types, list) or len(types) < n_layers or not set(types) <= set(INDEXER_TYPES):
        raise f.refuse(
            f"indexer_types (or index_topk_pattern) must mark each of the {n_layers} layers 'full' or 'shared' "
            "('F' or 'S' in a pattern string)"
        )
    if types[0] != "full":
        raise f.refuse(
            "layer 0 is marked 'shared', but a shared layer reuses the top-k of a full layer before it; "
            "the first layer must be 'full'"
        )
    return tuple(i for i in range(n_layers) if types[i] == "shared")
