"""Llama-4's language model, from the shared blocks: GQA whose layers rotate (interleaved-pair RoPE,
chunked attention, L2-normalized queries and keys) or not (NoPE: full attention, the attention
temperature on the queries); a top-1 sigmoid-routed MoE whose router score scales the expert's input,
beside a shared expert, or a dense MLP (eprt.families.llama4.config)."""

from __future__ import annotations

import torch
from torch import nn

from eprt.config import ModelConfig
from eprt.families.llama4.config import Llama4Config
from eprt.models.attention import GQAttention, causal_attention
from eprt.models.decoder import CausalLM, Decoder, DecoderLayer, attention_then_mlp
from eprt.models.layers import GatedMLP, linear
from eprt.models.moe import Experts, LocalDispatcher, MoE, held_experts
from eprt.models.rope import llama3_frequencies, rope_interleaved
from eprt.models.router import top_k
from eprt.models.vlm import LanguageModelOf


def l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm without a weight, in fp32, rounded back to x's dtype (the reference's qk norm)."""
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def temperature(seq_len: int, floor_scale: float, attn_scale: float, device) -> torch.Tensor:
    """fp32 [T, 1]: the NoPE layers' query scale at positions 0..T-1 (arXiv 2501.19399)."""
    positions = torch.arange(seq_len, device=device, dtype=torch.float32)
    return (torch.log1p(torch.floor((positions + 1.0) / floor_scale)) * attn_scale + 1.0)[:, None]


def same_chunk(seq_len: int, chunk: int, device) -> torch.Tensor | None:
    """bool [1, T, T]: query t may see key s of its own chunk; None where one chunk holds every position."""
    if seq_len <= chunk:
        return None
    chunk_T = torch.arange(seq_len, device=device) // chunk
    return (chunk_T[:, None] == chunk_T[None, :])[None]


class Llama4Attention(GQAttention):
    """Layer `i`'s attention: q/k/v/o as GQA's (no q/k norm weights), RoPE, L2 norm and chunking on
    the rope layers, the temperature on the NoPE layers. RoPE rotates interleaved pairs as the
    reference's complex multiplication does; its output comes de-interleaved (rope_interleaved), the
    same permutation for queries and keys, which neither their dot products nor the norm see."""

    def __init__(self, c: ModelConfig, i: int):
        super().__init__(c)
        own: Llama4Config = c.own
        self.rope = i in own.rope_layers
        self.qk_l2_norm = self.rope and own.qk_l2_norm
        self.chunk = own.attention_chunk_size if i in own.chunked_layers else None
        self.temperature = (own.floor_scale, own.attn_scale) if own.temperature_tuning and not self.rope else None
        self.eps = c.rms_norm_eps

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        q = self.q_proj(x_BTD).view(B, T, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.rope:
            q, k = rope_interleaved(q, cos, sin), rope_interleaved(k, cos, sin)
        if self.qk_l2_norm:
            q, k = l2_norm(q, self.eps), l2_norm(k, self.eps)
        if self.temperature is not None:
            q = (q * temperature(T, *self.temperature, q.device)).to(q.dtype)
        if self.taps.observe is not None:
            self.taps.observe(k, v)
        if self.taps.replace is not None:
            k, v = self.taps.replace(k, v)
        keep = same_chunk(T, self.chunk, q.device) if self.chunk else None
        return self.o_proj(causal_attention(q, k, v, self.head_dim**-0.5, keep))


class Llama4Router(nn.Module):
    """The top k router logits (best first, ties to the lower expert), each weighed by its sigmoid,
    computed in fp32 and rounded to the model dtype as the reference does."""

    def __init__(self, num_experts: int, hidden: int, k: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.k = k

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x_TD, self.weight)
        ids = top_k(logits, self.k)
        return ids, torch.sigmoid(logits.gather(1, ids).float()).to(x_TD.dtype).float()


class Llama4MoE(MoE):
    """One routed expert per token, whose INPUT the router's score scales (the experts' output is
    summed with weight 1), plus the shared expert on the unscaled input. The checkpoint names the
    router `router` and the shared expert `shared_expert`; `gate` and `shared_experts` are what the
    quantization passes read of every MoE block."""

    def __init__(self, router: Llama4Router, experts: Experts, shared_expert: GatedMLP):
        nn.Module.__init__(self)
        self.router, self.experts, self.shared_expert = router, experts, shared_expert
        self.dispatcher = LocalDispatcher()

    @property
    def gate(self) -> Llama4Router:
        return self.router

    @property
    def shared_experts(self) -> GatedMLP:
        return self.shared_expert

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        ids_T1, score_T1 = self.router(x_TD)
        return x_TD * score_T1.to(x_TD.dtype), ids_T1, torch.ones_like(score_T1)


class Llama4Decoder(Decoder):
    """The shared decoder, its rotary frequencies under Llama-3 scaling where the model has it."""

    def __init__(self, c: ModelConfig, layers: list[DecoderLayer]):
        super().__init__(c, layers)
        s = c.own.llama3_rope
        if s is not None:
            self.rotary.inv_freq = llama3_frequencies(
                self.rotary.inv_freq,
                s.factor,
                s.low_freq_factor,
                s.high_freq_factor,
                s.original_max_position_embeddings,
            )


class Llama4ForCausalLM(CausalLM):
    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        first, count = held_experts(expert_range, c.num_experts)
        D = c.hidden_size

        def feed_forward(i: int) -> nn.Module:
            if not c.is_moe(i):
                return GatedMLP(D, c.intermediate_size)
            m = c.moe
            return Llama4MoE(
                Llama4Router(m.num_experts, D, m.num_experts_per_tok),
                Experts(m.num_experts, first, count, D, m.intermediate_size),
                GatedMLP(D, m.intermediate_size),
            )

        # pre-norm attention then pre-norm FFN, the FFN named `feed_forward` as the checkpoint names it
        layers = [
            DecoderLayer(*attention_then_mlp(c, Llama4Attention(c, i), feed_forward(i), mlp_name="feed_forward"))
            for i in range(c.num_layers)
        ]
        super().__init__(c, layers, decoder=Llama4Decoder)


class Llama4ForConditionalGeneration(LanguageModelOf):
    """The VLM's language model under `language_model.`; the vision tower travels unchanged."""

    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(Llama4ForCausalLM(c, expert_range))
