"""GLM-5's tensors: DeepSeek-V3.2's, less the indexer of each layer that shares another's top-k."""

from __future__ import annotations

import dataclasses

from eprt.config import ModelConfig
from eprt.families.deepseek_v32 import layout as deepseek_v32
from eprt.layout import Layout


def layout(c: ModelConfig) -> Layout:
    base = deepseek_v32.layout(c)
    shared = tuple(f"model.layers.{i}.self_attn.indexer." for i in c.own.shared_index_layers)
    return dataclasses.replace(base, specs=tuple(s for s in base.specs if not s.name.startswith(shared)))
