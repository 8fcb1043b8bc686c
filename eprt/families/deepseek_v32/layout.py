"""DeepSeek-V3.2: the Hugging Face tensor layout, the checkpoint's tensors as eprt reads and writes them."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.families.deepseek_v3 import layout as deepseek_v3
from eprt.layout import Layout, mla_attention, plain


def attention(prefix: str, c: ModelConfig) -> list:
    """MLA's tensors, then the indexer's: its query from MLA's low-rank query, one key head with a
    LayerNorm, and a weight per head and token."""
    ix, D = c.indexer, c.hidden_size
    p = f"{prefix}.indexer"
    return mla_attention(prefix, c) + [
        plain(f"{p}.wq_b.weight", ix.n_heads * ix.head_dim, c.mla.q_lora_rank),
        plain(f"{p}.wk.weight", ix.head_dim, D),
        plain(f"{p}.k_norm.weight", ix.head_dim),
        plain(f"{p}.k_norm.bias", ix.head_dim),
        plain(f"{p}.weights_proj.weight", ix.n_heads, D),
    ]


def layout(c: ModelConfig) -> Layout:
    return deepseek_v3.decoder_layout(c, attention)
