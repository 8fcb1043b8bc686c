"""DeepSeek-V3.2 (`deepseek_v32`): DeepSeek-V3 plus DeepSeek Sparse Attention, a lightning indexer
in every attention layer that picks the `index_topk` keys each query attends to. Its projections
stay unquantized in every recipe (its family entry, eprt.families.deepseek_v32.FAMILY, says why)."""

from __future__ import annotations

import dataclasses

from eprt.config import IndexerConfig, ModelConfig, MoEConfig
from eprt.config_fields import Fields
from eprt.families.deepseek_v3 import config as deepseek_v3


def parse(hf: dict, source: str) -> ModelConfig:
    c = deepseek_v3.parse(hf, source)
    f = Fields(hf, source)
    if c.mla.q_lora_rank is None:
        raise f.refuse(
            "q_lora_rank is missing or 0; DeepSeek-V3.2's indexer reads the low-rank query "
            "(q_a_layernorm(q_a_proj x)), so the checkpoint must have one"
        )
    indexer = IndexerConfig(
        n_heads=f.get("index_n_heads", default=64),
        head_dim=f.get("index_head_dim", default=128),
        topk=f.get("index_topk", default=2048),
    )
    if not c.mla.qk_rope_head_dim <= indexer.head_dim:
        raise f.refuse(
            f"index_head_dim {indexer.head_dim} is less than qk_rope_head_dim {c.mla.qk_rope_head_dim}; the "
            "indexer rotates the leading qk_rope_head_dim dims of each of its heads"
        )
    if indexer.topk < 1 or indexer.n_heads < 1:
        raise f.refuse("index_topk and index_n_heads must be at least 1")
    return dataclasses.replace(c, family="deepseek_v32", moe=moe(f, c), indexer=indexer)


def moe(f: Fields, c: ModelConfig) -> MoEConfig | None:
    """DeepSeek-V3's MoE, its layers as `mlp_layer_types` lists them where the file has it
    ("dense" / "sparse" per layer: transformers 5 writes it and follows it over
    first_k_dense_replace; older files have only the latter)."""
    types = f.get("mlp_layer_types", default=None)
    if types is None or c.moe is None:
        return c.moe
    if not isinstance(types, list) or len(types) != c.num_layers or not set(types) <= {"dense", "sparse"}:
        raise f.refuse(f"mlp_layer_types must list 'dense' or 'sparse' for each of the {c.num_layers} layers")
    layers = tuple(i for i, t in enumerate(types) if t == "sparse")
    return dataclasses.replace(c.moe, layers=layers) if layers else None
