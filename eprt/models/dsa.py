"""DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2).

From MLA's low-rank query latent and the layer input x, per token t and earlier token s:
    q_t = wq_b(latent_t) in n heads of d,  k_s = LayerNorm(wk x_s) (one head of d),
    each with RoPE on its leading qk_rope_head_dim dims: rotate-half in DeepSeek-V3.2 (MLA itself
    rotates interleaved), interleaved in GLM-5,
    I(t, s) = sum_h w_th * relu(q_th . k_s * d^-0.5),  w_t = weights_proj(x_t) * n^-0.5,
and query t attends to the `topk` keys s <= t of highest I(t, s); with t + 1 <= topk keys before it,
to all of them. Scores are fp32. Among equal scores the lower position wins, as in DeepSeek's own
inference code, whose torch.topk on CUDA fills the places left at the k-th score in index order.
Ties are common: a key scores exactly 0 wherever every head's q . k is negative.
The reference runs the Hadamard rotation and FP8 scoring of DeepSeek's kernels in full precision:
the rotation leaves the dot products unchanged, and eprt does the same.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eprt.config import ModelConfig
from eprt.models.layers import Linear
from eprt.models.rope import rope_interleaved, rope_rotate_half
from eprt.models.router import top_k

# The reference builds the indexer's key LayerNorm with eps 1e-6, whatever rms_norm_eps says.
KEY_NORM_EPS = 1e-6


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)


class Indexer(nn.Module):
    def __init__(self, c: ModelConfig, interleaved_rope: bool = False):
        super().__init__()
        self.rope = rope_interleaved if interleaved_rope else rope_rotate_half
        ix = c.indexer
        self.n_heads, self.head_dim, self.topk = ix.n_heads, ix.head_dim, ix.topk
        self.wq_b = Linear(c.mla.q_lora_rank, ix.n_heads * ix.head_dim)
        self.wk = Linear(c.hidden_size, ix.head_dim)
        self.k_norm = LayerNorm(ix.head_dim, KEY_NORM_EPS)
        self.weights_proj = Linear(c.hidden_size, ix.n_heads)

    def forward(
        self, x_BTD: torch.Tensor, q_latent_BTZ: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """keep [B, T, T]: True where query t may attend to key s (the causal mask still applies)."""
        B, T, _ = x_BTD.shape
        q_BTHd = self.rope(self.wq_b(q_latent_BTZ).view(B, T, self.n_heads, self.head_dim), cos[:, None], sin[:, None])
        k_BTd = self.rope(self.k_norm(self.wk(x_BTD)), cos, sin)
        scores_BTHS = F.relu(q_BTHd.float() @ k_BTd.float().transpose(-1, -2)[:, None] * self.head_dim**-0.5)
        w_BTH = self.weights_proj(x_BTD).float() * self.n_heads**-0.5
        index_BTS = (w_BTH[:, :, None, :] @ scores_BTHS).squeeze(-2)
        causal = torch.ones(T, T, dtype=torch.bool, device=x_BTD.device).tril()
        index_BTS = index_BTS.masked_fill(~causal, float("-inf"))
        k = min(self.topk, T)
        # explicit sizes: an empty batch (a rank with no sequence this step) has no -1 to infer
        picked = top_k(index_BTS.reshape(B * T, T), k).view(B, T, k)
        return torch.zeros(B, T, T, dtype=torch.bool, device=x_BTD.device).scatter_(-1, picked, True)
