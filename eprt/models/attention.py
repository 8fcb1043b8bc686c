"""Grouped-query attention (Qwen3, GLM-4.5, Qwen3-Next's gated one, MiniMax-M2, GPT-OSS's with sinks and
sliding windows), and the causal attention core."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eprt.config import ModelConfig
from eprt.models.balance import Balance, BalanceGroup, Unbalanced
from eprt.models.layers import Linear, RMSNorm
from eprt.models.rope import rope_rotate_half
from eprt.models.taps import KVTaps


def causal_attention(
    q_BHTd: torch.Tensor,
    k_BhTd: torch.Tensor,
    v_BhTe: torch.Tensor,
    scale: float,
    keep_BTS: torch.Tensor | None = None,
    sinks_H: torch.Tensor | None = None,
) -> torch.Tensor:
    """softmax(q k^T * scale + causal mask) v, with h key/value heads shared by H/h query heads;
    with `keep_BTS` (sparse attention) query t sees only the earlier keys s it marks True: the same
    for every head, or, [B, n, T, S], its own for each of n groups of H/n consecutive heads. With
    `sinks_H` (GPT-OSS) each head's softmax has one more logit, sinks_H[h], whose value is zero:
    it takes its share of every query's attention and gives nothing back. Returns [B, T, H*e]."""
    B, H, T, _ = q_BHTd.shape
    if keep_BTS is not None and keep_BTS.dim() == 4:
        assert sinks_H is None, "sinks with a key choice per group of heads"
        return grouped_causal_attention(q_BHTd, k_BhTd, v_BhTe, scale, keep_BTS)
    mask = None
    if keep_BTS is not None or sinks_H is not None:
        causal = torch.ones(T, T, dtype=torch.bool, device=q_BHTd.device).tril()
        mask = (causal[None] if keep_BTS is None else keep_BTS & causal)[:, None]
    if sinks_H is not None:
        q_BHTd, k_BhTd, v_BhTe, mask = with_sink_key(q_BHTd, k_BhTd, v_BhTe, scale, sinks_H, mask)
    o = F.scaled_dot_product_attention(
        q_BHTd, k_BhTd, v_BhTe, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=k_BhTd.shape[1] != H
    )
    # explicit sizes: an empty batch (a rank with no sequence this step) has no -1 to infer
    return o.transpose(1, 2).reshape(B, T, H * v_BhTe.shape[-1])


# the dims the sink key adds to each head: one carries it, the rest keep a width that is a multiple of 8
# one (the fused kernels' alignment)
SINK_WIDTH = 8


def with_sink_key(
    q_BHTd: torch.Tensor,
    k_BhTd: torch.Tensor,
    v_BhTe: torch.Tensor,
    scale: float,
    sinks_H: torch.Tensor,
    mask_B1TS: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The sinks as one more key that every query sees, so that the fused attention kernels compute
    them: each query head gains a dim holding sinks_H[h] / scale, each key a zero there, and the sink
    key (a one there, zeros elsewhere, a zero value) scores exactly sinks_H[h] against every query
    of head h. The key/value heads stay shared."""
    B, H, T, d = q_BHTd.shape
    pad = q_BHTd.new_zeros(B, H, T, SINK_WIDTH)
    pad[..., 0] = (sinks_H.to(q_BHTd.dtype) / scale)[None, :, None]
    q = torch.cat((q_BHTd, pad), dim=-1)
    h = k_BhTd.shape[1]
    sink_key = k_BhTd.new_zeros(B, h, 1, d + SINK_WIDTH)
    sink_key[..., d] = 1
    k = torch.cat((torch.cat((k_BhTd, k_BhTd.new_zeros(B, h, T, SINK_WIDTH)), dim=-1), sink_key), dim=2)
    v = torch.cat((v_BhTe, v_BhTe.new_zeros(B, h, 1, v_BhTe.shape[-1])), dim=2)
    mask = torch.cat((mask_B1TS, mask_B1TS.new_ones(*mask_B1TS.shape[:-1], 1)), dim=-1)
    return q, k, v, mask


def sliding_window(seq_len: int, window: int, device) -> torch.Tensor | None:
    """bool [1, T, T]: query t may see key s where t - s < window (its own among them); None where the
    window holds every earlier position."""
    if seq_len <= window:
        return None
    t = torch.arange(seq_len, device=device)
    return (t[:, None] - t[None, :] < window)[None]


def grouped_causal_attention(
    q_BHTd: torch.Tensor, k_BhTd: torch.Tensor, v_BhTe: torch.Tensor, scale: float, keep_BnTS: torch.Tensor
) -> torch.Tensor:
    """causal_attention with a key choice per group of heads, one group at a time: a mask of one
    group's size is alive at once, not one per head. Query head j reads key/value head j // (H/h),
    so a group's heads read a consecutive run of key/value heads (or share one)."""
    H, h, n = q_BHTd.shape[1], k_BhTd.shape[1], keep_BnTS.shape[1]
    per_group, per_kv = H // n, H // h
    outs = []
    for g in range(n):
        first, last = g * per_group, (g + 1) * per_group
        kv = slice(first // per_kv, (last - 1) // per_kv + 1)
        outs.append(causal_attention(q_BHTd[:, first:last], k_BhTd[:, kv], v_BhTe[:, kv], scale, keep_BnTS[:, g]))
    return torch.cat(outs, dim=-1)


class GQAttention(nn.Module):
    """As `c.gqa` says (Qwen3, GLM-4.5, Qwen3-Next): the q/k norm optional, RoPE partial (the
    cos/sin tables are then narrower than a head), biases optional and, with `output_gate`, q_proj
    giving each head a gate beside its query: the attention output is multiplied by sigmoid(gate)
    before o_proj. `norm` is the q/k norm's kind; it normalizes each head apart, or with
    `whole_qk_norm` (MiniMax-M2) all the heads of q, and of k, as one vector. The whole projection
    is on every rank here (eprt splits no heads), so that norm needs nothing gathered; an engine
    that splits heads over tensor-parallel ranks sums the squares over them first (vLLM's
    MiniMaxText01RMSNormTP). With `sinks` each head has a learned sink logit (`sinks` [H],
    causal_attention's); with `window` each query sees only the `window` latest keys, its own
    among them (a sliding-window layer: GPT-OSS's)."""

    def __init__(
        self,
        c: ModelConfig,
        norm: type[RMSNorm] = RMSNorm,
        whole_qk_norm: bool = False,
        *,
        sinks: bool = False,
        window: int | None = None,
    ):
        super().__init__()
        g = c.gqa
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_heads, g.num_kv_heads, g.head_dim
        assert c.num_heads % g.num_kv_heads == 0, (c.num_heads, g.num_kv_heads)
        hd = g.head_dim
        self.output_gate = g.output_gate
        self.q_proj = Linear(c.hidden_size, c.num_heads * hd * (2 if self.output_gate else 1), bias=g.qkv_bias)
        self.k_proj = Linear(c.hidden_size, g.num_kv_heads * hd, bias=g.qkv_bias)
        self.v_proj = Linear(c.hidden_size, g.num_kv_heads * hd, bias=g.qkv_bias)
        self.o_proj = Linear(c.num_heads * hd, c.hidden_size, bias=g.output_bias)
        assert not (whole_qk_norm and self.output_gate), "a whole-projection q norm would mix in the gates"
        self.whole_qk_norm = whole_qk_norm
        q_width, k_width = (c.num_heads * hd, g.num_kv_heads * hd) if whole_qk_norm else (hd, hd)
        self.q_norm = norm(q_width, c.rms_norm_eps) if g.qk_norm else None
        self.k_norm = norm(k_width, c.rms_norm_eps) if g.qk_norm else None
        self.sinks = nn.Parameter(torch.empty(c.num_heads)) if sinks else None
        self.window = window
        self.taps = KVTaps()  # the keys and values, observed or replaced (eprt.models.taps)

    def balance_groups(self, norm: nn.Module) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): q/k/v read the norm's output; o_proj reads v, which
        attention (and the output gate) passes through linearly, unless v_proj has a bias
        (GLM-4.5's), which the fold would have to follow."""
        values = (
            Unbalanced(self.o_proj, "its input: v_proj has a bias")
            if self.v_proj.bias is not None
            else BalanceGroup(
                "attention values", self.v_proj, (self.o_proj,), (self.num_heads // self.num_kv_heads, self.head_dim)
            )
        )
        return [BalanceGroup("attention input", norm, self.input_readers()), values]

    def input_readers(self) -> tuple[nn.Module, ...]:
        """The modules that read the attention's input: what a transform of that input (AWQ's
        scales, a rotation) must reach."""
        return self.q_proj, self.k_proj, self.v_proj

    def keep(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """Sparse attention's choice of keys (causal_attention's keep): the sliding window where the
        layer has one, else None: every earlier key."""
        return None if self.window is None else sliding_window(x_BTD.shape[1], self.window, x_BTD.device)

    def forward(
        self, x_BTD: torch.Tensor, cos: torch.Tensor | None = None, sin: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Without rotary tables (a block built with rotary=False: Nemotron-H's), no position is encoded."""
        B, T, _ = x_BTD.shape
        q, k = self.q_proj(x_BTD), self.k_proj(x_BTD)
        if self.whole_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, T, self.num_heads, self.head_dim * (2 if self.output_gate else 1))
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
        k = k.view(B, T, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.whole_qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(x_BTD).view(B, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if cos is not None:
            q, k = rope_rotate_half(q, cos, sin), rope_rotate_half(k, cos, sin)
        if self.taps.observe is not None:
            self.taps.observe(k, v)
        if self.taps.replace is not None:
            k, v = self.taps.replace(k, v)
        o = causal_attention(q, k, v, self.head_dim**-0.5, self.keep(x_BTD, cos, sin), self.sinks)
        if self.output_gate:
            o = o * torch.sigmoid(gate.flatten(-2))
        return self.o_proj(o)
