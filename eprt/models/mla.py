"""Multi-head latent attention (DeepSeek-V3, Kimi-K2; without RoPE in Kimi-Linear and Kimi-K3).

q = q_b(norm(q_a x)) (or q_proj x), per head [nope | rope]; the latent [c | k_pe] = kv_a x,
c normalized and expanded by kv_b into per-head [k_nope | v]; k_pe is one rope head shared by all.
Without RoPE (NoPE: `config.rope` None) nothing rotates: the "rope" parts are plain dimensions
of q and of the shared key.
With the output gate (Kimi-K3) the heads' output is multiplied by sigmoid(g_proj x) before o_proj.
With an indexer (DeepSeek-V3.2) each query attends only to the keys the indexer picks for it.
With a query temperature (Mistral-Small-4: Llama-4's `(beta, positions)`, see
`eprt.models.rope.llama4_attention_scale`) each query is scaled by its position's factor after RoPE.
With index sharing (GLM-5) a layer leaves its indexer's pick in the layer context (`carried`,
under INDEX_KEEP), and a layer without an indexer of its own attends to the keys found there: those
the last layer that ran one picked.
"""

from __future__ import annotations

import torch
from torch import nn

from eprt.config import ModelConfig
from eprt.models.attention import causal_attention
from eprt.models.balance import Balance, BalanceGroup
from eprt.models.layers import Linear, RMSNorm
from eprt.models.rope import llama4_attention_scale, rope_interleaved, yarn_softmax_scale
from eprt.models.taps import KVTaps

# The reference builds q_a_layernorm and kv_a_layernorm with the RMSNorm default eps, not
# rms_norm_eps (DeepSeek's own inference code does the same).
LATENT_NORM_EPS = 1e-6
# index sharing: the name, in LayerContext.carried, of the keys [B, T, T] the last indexer picked
INDEX_KEEP = "index_keep"


class MLAttention(nn.Module):
    """`c.mla`'s attention, rotating the rope dims where the model has RoPE (`c.rope`)."""

    def __init__(
        self,
        c: ModelConfig,
        output_gate: bool = False,
        indexer: nn.Module | None = None,
        query_temperature: tuple[float, int] | None = None,
    ):
        super().__init__()
        m = c.mla
        self.num_heads = c.num_heads
        self.nope, self.rope, self.v_dim = m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim
        self.kv_lora_rank = m.kv_lora_rank
        qk = self.nope + self.rope
        D = c.hidden_size
        if m.q_lora_rank:
            self.q_a_proj = Linear(D, m.q_lora_rank)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(m.q_lora_rank, c.num_heads * qk)
        else:
            self.q_proj = Linear(D, c.num_heads * qk)
        self.kv_a_proj_with_mqa = Linear(D, m.kv_lora_rank + self.rope)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(m.kv_lora_rank, c.num_heads * (self.nope + self.v_dim))
        self.o_proj = Linear(c.num_heads * self.v_dim, D)
        self.g_proj = Linear(D, c.num_heads * self.v_dim) if output_gate else None
        self.use_rope = c.rope is not None
        self.scale = qk**-0.5 * (yarn_softmax_scale(c.rope.yarn) if self.use_rope else 1.0)
        self.q_lora = bool(m.q_lora_rank)
        # indexer(x, q_latent, cos, sin) -> keep [B, T, T]: the keys each query may attend to
        self.indexer = indexer
        self.query_temperature = query_temperature
        self.taps = KVTaps()  # the keys and values, observed or replaced (eprt.models.taps)

    def balance_groups(self, norm: nn.Module) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): what reads the norm's output, the query's first
        projection, the latent's, the indexer's wk and weights_proj (DeepSeek-V3.2), the output gate
        (Kimi's). The values come out of kv_b_proj beside the keys: v -> o is not balanced."""
        readers = [self.q_a_proj if self.q_lora else self.q_proj, self.kv_a_proj_with_mqa]
        if self.indexer is not None:
            readers += [self.indexer.wk, self.indexer.weights_proj]
        if self.g_proj is not None:
            readers.append(self.g_proj)
        return [BalanceGroup("attention input", norm, tuple(readers))]

    def forward(
        self,
        x_BTD: torch.Tensor,
        cos: torch.Tensor | None = None,
        sin: torch.Tensor | None = None,
        carried: dict[str, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """`carried` (index sharing: eprt.models.decoder.LayerContext.carried): this layer leaves
        its indexer's keep there under INDEX_KEEP if it runs one, else attends to the keep found
        there (none, for a layer run alone, as the time probe does: to every earlier key)."""
        B, T, _ = x_BTD.shape
        nh = self.num_heads
        q_latent = self.q_a_layernorm(self.q_a_proj(x_BTD)) if self.q_lora else None
        q = self.q_b_proj(q_latent) if self.q_lora else self.q_proj(x_BTD)
        q_nope, q_pe = q.view(B, T, nh, self.nope + self.rope).transpose(1, 2).split([self.nope, self.rope], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x_BTD).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(c)).view(B, T, nh, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
        k_pe = k_pe.view(B, 1, T, self.rope)
        if self.use_rope:
            q_pe, k_pe = rope_interleaved(q_pe, cos, sin), rope_interleaved(k_pe, cos, sin)
        q = torch.cat((q_nope, q_pe), dim=-1)
        if self.query_temperature is not None:
            q = q * llama4_attention_scale(T, *self.query_temperature, q.dtype, q.device)
        k = torch.cat((k_nope, k_pe.expand(B, nh, T, self.rope)), dim=-1)
        if self.taps.observe is not None:
            self.taps.observe(k, v)
        if self.taps.replace is not None:
            k, v = self.taps.replace(k, v)
        keep = None
        if self.indexer is not None:
            keep = self.indexer(x_BTD, q_latent, cos, sin)
            if carried is not None:
                carried[INDEX_KEEP] = keep
        elif carried is not None:
            keep = carried.get(INDEX_KEEP)
        o = causal_attention(q, k, v, self.scale, keep)
        if self.g_proj is not None:
            o = o * torch.sigmoid(self.g_proj(x_BTD))
        return self.o_proj(o)
