"""DeepSeek-V4's model, as transformers 5.25 computes it (the tests' oracle; docs/models.md says where
DeepSeek's own inference code differs and why eprt follows transformers).

Every layer keeps `hc_mult` residual streams [B, T, n, D]. Each of its two blocks (attention, then
the MoE) reads a mixture of the streams whose weights it computes from them (hyper-connections:
`pre` collapses the streams into the block's input, `post` spreads its output over them, `comb`, a
Sinkhorn-normalised n x n matrix, mixes the old streams into the new). The attention is MQA with one
key=value head, RoPE on the trailing dims of each head in interleaved pairs, a per-head sink, a
sliding window, and, per layer, compressed entries of the whole past (CSA: every `csa_rate` tokens
pooled over overlapping windows, an indexer choosing `index_topk` of them per query; HCA: every
`hca_rate` tokens, all visible); its output goes through a grouped low-rank projection. The MoE
routes by sqrt(softplus) scores (plus a bias for the choice) or, on the hash layers, by a table of
each token id's experts (`tid2eid`), which the layer reads from the context (`TOKENS`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eprt.config import ModelConfig, RopeConfig
from eprt.errors import ConfigError
from eprt.families.deepseek_v3.model import tokens_ahead
from eprt.families.deepseek_v4.config import CSA, SLIDING
from eprt.families.deepseek_v4.layout import pieces
from eprt.models.decoder import Block, CausalLM, Decoder, DecoderLayer, DecoderParts, LayerContext
from eprt.models.layers import GatedMLP, Linear, RMSNorm, SiLUMulLimit, linear
from eprt.models.moe import Experts, MoE, held_experts
from eprt.models.rope import rope_frequencies
from eprt.models.router import top_k

TOKENS = "input_ids"  # the context's entry of each sequence's token ids [B, T], for hash routing


class Norm(RMSNorm):
    """RMSNorm scaled in fp32 before the one cast back (DeepSeek-V4 keeps its norms' weights in fp32)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps))).to(x.dtype)


def unweighted_rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class PairRotary:
    """cos and sin [T, dim/2] at given positions, one angle per interleaved pair of a head's
    trailing `dim` dims (the layer's RoPE: plain for a sliding-window layer, YaRN for a compressed one)."""

    def __init__(self, dim: int, rope: RopeConfig, max_position_embeddings: int):
        self.inv_freq, self.factor = rope_frequencies(dim, rope.theta, rope.yarn, max_position_embeddings)

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions[:, None].float() * self.inv_freq.to(positions.device)
        return (freqs.cos() * self.factor).to(dtype), (freqs.sin() * self.factor).to(dtype)


def rotate_trailing(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [..., T, d]: its last 2 * cos.shape[-1] dims rotated in place, pair (x_2i, x_2i+1) by angle
    i, in fp32; the leading dims unchanged."""
    r = 2 * cos.shape[-1]
    rope = x[..., -r:]
    even, odd, c, s = rope[..., 0::2].float(), rope[..., 1::2].float(), cos.float(), sin.float()
    rotated = torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2).to(x.dtype)
    return torch.cat([x[..., :-r], rotated], dim=-1)


def overlapped(t: torch.Tensor, width: int, fill: float) -> torch.Tensor:
    """[B, W, r, 2w] -> [B, W, 2r, w]: window j's entries of the second series after window j-1's
    of the first (window 0's first half `fill`), so that windows of 2r overlap by r."""
    B, W, r, _ = t.shape
    out = t.new_full((B, W, 2 * r, width), fill)
    out[:, :, r:] = t[..., width:]
    out[:, 1:, :r] = t[:, :-1, :, :width]
    return out


class Compressor(nn.Module):
    """One entry of `width` per `rate` tokens: the window's kv, weighted by a softmax over the
    window of gate + ape (per position in the window), summed, normed and RoPE'd at the window's
    first position. With `overlap` (CSA's) each token gives two series and a window of 2 x rate
    tokens pools the previous window's first series with its own second."""

    def __init__(self, hidden: int, width: int, rate: int, overlap: bool, eps: float):
        super().__init__()
        self.width, self.rate, self.overlap = width, rate, overlap
        self.series = w = (2 if overlap else 1) * width
        self.ape = nn.Parameter(torch.empty(rate, w))
        self.wkv = Linear(hidden, w)
        self.wgate = Linear(hidden, w)
        self.norm = Norm(width, eps)

    def forward(self, x_BTD: torch.Tensor, rotary: PairRotary) -> torch.Tensor:
        """[B, T // rate, width]: the entries of the complete windows."""
        B, T, _ = x_BTD.shape
        r = self.rate
        W = T // r
        kv = self.wkv(x_BTD)[:, : W * r].view(B, W, r, self.series)
        gate = self.wgate(x_BTD)[:, : W * r].view(B, W, r, self.series) + self.ape
        if self.overlap:
            kv, gate = overlapped(kv, self.width, 0.0), overlapped(gate, self.width, float("-inf"))
        pooled = self.norm((kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
        cos, sin = rotary(torch.arange(W, device=x_BTD.device) * r, x_BTD.dtype)
        return rotate_trailing(pooled, cos, sin)


def entries_seen(T: int, W: int, rate: int, device) -> torch.Tensor:
    """[T, W]: whether query t may see compressed entry w, whose window ends at or before t."""
    return torch.arange(W, device=device)[None, :] < ((torch.arange(T, device=device) + 1) // rate)[:, None]


class Indexer(nn.Module):
    """CSA's choice of compressed entries: per query t and entry s, with its own compressor's
    entries k_s and n heads of queries q_t,h (from the attention's low-rank q):
        score(t, s) = sum_h w_t,h relu(q_t,h . k_s) / sqrt(d),  w_t = weights_proj(x_t) / sqrt(n);
    query t keeps its `topk` best entries among those it may see."""

    def __init__(self, c: ModelConfig, rate: int):
        super().__init__()
        own = c.own
        self.n_heads, self.head_dim, self.topk, self.rate = own.index_n_heads, own.index_head_dim, own.index_topk, rate
        self.wq_b = Linear(own.q_lora_rank, own.index_n_heads * own.index_head_dim)
        self.weights_proj = Linear(c.hidden_size, own.index_n_heads)
        self.compressor = Compressor(c.hidden_size, own.index_head_dim, rate, True, c.rms_norm_eps)

    def forward(self, x_BTD: torch.Tensor, q_BTR: torch.Tensor, rotary: PairRotary) -> torch.Tensor:
        """The attention's bias over the compressed entries [B, 1, T, W]: 0 where kept, else -inf."""
        B, T, _ = x_BTD.shape
        keys = self.compressor(x_BTD, rotary)
        W = keys.shape[1]
        cos, sin = rotary(torch.arange(T, device=x_BTD.device), x_BTD.dtype)
        q = self.wq_b(q_BTR).view(B, T, self.n_heads, self.head_dim)  # explicit dims: a rank may hold no sequence
        q = rotate_trailing(q.transpose(1, 2), cos, sin).transpose(1, 2)
        scores = F.relu(q.float() @ keys.transpose(-1, -2).float().unsqueeze(1)) * self.head_dim**-0.5
        weights = self.weights_proj(x_BTD).float() * self.n_heads**-0.5
        score_BTW = (scores * weights.unsqueeze(-1)).sum(dim=2)
        seen = entries_seen(T, W, self.rate, x_BTD.device)
        score_BTW = score_BTW.masked_fill(~seen, float("-inf")).reshape(B * T, W)
        picked = top_k(score_BTW, min(self.topk, W))
        real = seen.repeat(B, 1).gather(1, picked)  # a pick among entries it may not see keeps nothing
        keep = torch.zeros(B * T, W + 1, dtype=torch.bool, device=x_BTD.device)
        keep.scatter_(1, picked.masked_fill(~real, W), True)
        return additive(keep[:, :W].view(B, 1, T, W), x_BTD.dtype)


def additive(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return torch.zeros(keep.shape, dtype=dtype, device=keep.device).masked_fill(~keep, float("-inf"))


class V4Attention(nn.Module):
    """MQA with one key=value head: q through a low-rank pair and a per-head RMSNorm, kv one head
    normed; RoPE on each head's trailing dims (undone on the output); over the sliding window and,
    in a compressed layer, the compressed entries the layer lets each query see; a per-head sink
    in the softmax; the heads' outputs in `o_groups` groups, each projected to `o_lora_rank`
    (wo_a, one block per group), then all to the hidden size (wo_b)."""

    def __init__(self, c: ModelConfig, i: int):
        super().__init__()
        own, D, H = c.own, c.hidden_size, c.num_heads
        self.kind, self.eps, self.window = own.kind(i), c.rms_norm_eps, own.sliding_window
        self.n_heads, self.head_dim, self.groups = H, own.head_dim, own.o_groups
        self.attn_sink = nn.Parameter(torch.empty(H))
        self.wq_a = Linear(D, own.q_lora_rank)
        self.q_norm = Norm(own.q_lora_rank, c.rms_norm_eps)
        self.wq_b = Linear(own.q_lora_rank, H * own.head_dim)
        self.wkv = Linear(D, own.head_dim)
        self.kv_norm = Norm(own.head_dim, c.rms_norm_eps)
        self.wo_a = Linear(H * own.head_dim // own.o_groups, own.o_groups * own.o_lora_rank)
        self.wo_b = Linear(own.o_groups * own.o_lora_rank, D)
        if self.kind != SLIDING:
            self.compressor = Compressor(D, own.head_dim, own.rate(i), self.kind == CSA, c.rms_norm_eps)
        if self.kind == CSA:
            self.indexer = Indexer(c, own.rate(i))
        self.rate = own.rate(i)
        rope = c.rope if self.kind == SLIDING else own.compress_rope
        self.rotary = PairRotary(c.rotary_dim, rope, c.max_position_embeddings)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        B, T, _ = x_BTD.shape
        cos, sin = self.rotary(torch.arange(T, device=x_BTD.device), x_BTD.dtype)
        q_BTR = self.q_norm(self.wq_a(x_BTD))
        q = unweighted_rms(self.wq_b(q_BTR).view(B, T, self.n_heads, self.head_dim).transpose(1, 2), self.eps)
        q = rotate_trailing(q, cos, sin)
        kv = rotate_trailing(self.kv_norm(self.wkv(x_BTD))[:, None], cos, sin)  # [B, 1, T, hd]
        t = torch.arange(T, device=x_BTD.device)
        bias = additive(((t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < self.window)), x_BTD.dtype)
        bias = bias.expand(B, 1, T, T)
        if self.kind != SLIDING:
            entries = self.compressor(x_BTD, self.rotary)
            seen = entries_seen(T, entries.shape[1], self.rate, x_BTD.device)
            picked = self.indexer(x_BTD, q_BTR, self.rotary) if self.kind == CSA else additive(seen, x_BTD.dtype)
            kv = torch.cat([kv, entries[:, None]], dim=2)
            bias = torch.cat([bias, picked.expand(B, 1, T, -1)], dim=-1)
        out = sink_attention(q, kv, bias, self.attn_sink, self.head_dim**-0.5)
        per_group = self.n_heads * self.head_dim // self.groups
        out = rotate_trailing(out, cos, -sin).transpose(1, 2).reshape(B * T, self.groups, per_group)
        w = self.wo_a.weight.view(self.groups, -1, per_group).transpose(1, 2)
        grouped = torch.bmm(out.transpose(0, 1), w).transpose(0, 1).reshape(B, T, self.wo_a.weight.shape[0])
        return self.wo_b(grouped)


def sink_attention(
    q: torch.Tensor, kv: torch.Tensor, bias: torch.Tensor, sinks: torch.Tensor, scale: float
) -> torch.Tensor:
    """softmax over [q.k * scale + bias, the head's sink] without the sink's column, times kv:
    q [B, H, T, d], kv [B, 1, S, d] (keys and values alike), bias [B, 1, T, S] -> [B, H, T, d]."""
    B, H, T, _ = q.shape
    logits = torch.matmul(q, kv.transpose(-1, -2)) * scale + bias
    combined = torch.cat([logits, sinks.reshape(1, -1, 1, 1).expand(B, H, T, 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    probs = F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1]
    return torch.matmul(probs.to(kv.dtype), kv)


class V4Router(nn.Module):
    """scores = sqrt(softplus(x . weight)) in fp32; the top k of scores + bias (on a hash layer:
    the token's row of `tid2eid`); weights the chosen scores over their sum, times `scaling`."""

    def __init__(self, c: ModelConfig, hashed: bool):
        super().__init__()
        m = c.moe
        self.k, self.scaling, self.hashed = m.num_experts_per_tok, m.routed_scaling_factor, hashed
        self.weight = nn.Parameter(torch.empty(m.num_experts, c.hidden_size))
        if hashed:
            # every token to expert 0 until the checkpoint's table is read (transformers' init)
            self.register_buffer("tid2eid", torch.zeros(c.vocab_size, m.num_experts_per_tok, dtype=torch.int64))
        else:
            self.bias = nn.Parameter(torch.empty(m.num_experts))

    def forward(self, x_TD: torch.Tensor, tokens_T: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        scores = F.softplus(linear(x_TD.float(), self.weight.float())).sqrt()
        if not self.hashed:
            ids = top_k(scores + self.bias.float(), self.k)
        elif tokens_T is None:
            raise ConfigError("a DeepSeek-V4 hash-routed layer reads each token's id from the layer context")
        else:
            ids = self.tid2eid[tokens_T].long()
        w = scores.gather(1, ids)
        return ids, w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.scaling


class SharedExpert(GatedMLP):
    """The shared expert under DeepSeek's names: w1 the gate, w3 up, w2 down."""

    def __init__(self, hidden: int, width: int, act):
        nn.Module.__init__(self)
        self.w1, self.w2, self.w3 = Linear(hidden, width), Linear(width, hidden), Linear(hidden, width)
        self.act = act

    gate_proj = property(lambda self: self.w1)
    up_proj = property(lambda self: self.w3)
    down_proj = property(lambda self: self.w2)


class TokenRoutedMoE(MoE):
    """The MoE whose router may read each token's id (`TOKENS` in the context's carried entries)."""

    def forward(self, x_BTD: torch.Tensor, carried: dict[str, torch.Tensor] | None = None) -> torch.Tensor:
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        tokens = (carried or {}).get(TOKENS)
        experts_in_TD, ids_TK, w_TK = self.route(x_TD, None if tokens is None else tokens.reshape(-1))
        return self.finish(x_TD, self.dispatcher(experts_in_TD, ids_TK, w_TK, self.experts)).view_as(x_BTD)

    def route(self, x_TD: torch.Tensor, tokens_T: torch.Tensor | None = None):
        ids_TK, w_TK = self.gate(x_TD, tokens_T)
        return x_TD, ids_TK, w_TK


def hyper_weights(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, c: ModelConfig):
    """(pre [B, T, n], post [B, T, n], comb [B, T, n, n]) of the streams x [B, T, n, D], in fp32:
    sigmoids and a softmax of a linear map of the normed streams, comb made doubly stochastic by
    Sinkhorn's alternate row and column normalisation."""
    own = c.own
    n, eps = own.hc_mult, own.hc_eps
    mixes = F.linear(unweighted_rms(x.flatten(2).float(), c.rms_norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (n, n)) * scale[2] + comb_b.view(n, n), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(own.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class HyperConnectedLayer(DecoderLayer):
    """Attention then the MoE, joined to the residual streams by hyper-connections (`hc_attn_*`,
    `hc_ffn_*`): a block reads the streams mixed by `pre`; the streams after it are post x its
    output plus comb^T applied to the streams before it."""

    def __init__(self, c: ModelConfig, i: int, expert_range: tuple[int, int] | None):
        D, eps, n = c.hidden_size, c.rms_norm_eps, c.own.hc_mult
        super().__init__(
            (Block("attn_norm", "attn"), Norm(D, eps), V4Attention(c, i)),
            (Block("ffn_norm", "ffn", carries=True), Norm(D, eps), moe(c, i, expert_range)),
        )
        self.config = c
        mix = (2 + n) * n
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.empty(mix, n * D)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.empty(mix)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.empty(3)))

    def enter(self, k: int, x: torch.Tensor, ctx: LayerContext):
        part = self.blocks[k].mixer
        pre, post, comb = hyper_weights(
            x, *(getattr(self, f"hc_{part}_{p}") for p in ("fn", "base", "scale")), self.config
        )
        return (x, post, comb), (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)

    def leave(self, k: int, carry, y: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        x, post, comb = carry
        return post.to(x.dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(comb.to(x.dtype).transpose(-1, -2), x)

    def route(self, m_TD: torch.Tensor, ctx: LayerContext):
        tokens = ctx.carried.get(TOKENS)
        return self.ffn.route(m_TD, None if tokens is None else tokens.reshape(-1))


def moe(c: ModelConfig, i: int, expert_range: tuple[int, int] | None) -> TokenRoutedMoE:
    m, D = c.moe, c.hidden_size
    first, count = held_experts(expert_range, m.num_experts)
    act = SiLUMulLimit(c.own.swiglu_limit)
    return TokenRoutedMoE(
        V4Router(c, i in c.own.hash_layers),
        Experts(m.num_experts, first, count, D, m.intermediate_size, pieces=pieces(c)),
        SharedExpert(D, m.intermediate_size, act),
    )


class HyperHead(nn.Module):
    """The streams collapsed once more before the final norm, by sigmoid weights of their own."""

    def __init__(self, c: ModelConfig):
        super().__init__()
        n, D = c.own.hc_mult, c.hidden_size
        self.eps, self.hc_eps = c.rms_norm_eps, c.own.hc_eps
        self.hc_fn = nn.Parameter(torch.empty(n, n * D))
        self.hc_base = nn.Parameter(torch.empty(n))
        self.hc_scale = nn.Parameter(torch.empty(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return collapse(x, self.hc_fn, self.hc_base, self.hc_scale, self.eps, self.hc_eps)


def collapse(x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, eps: float, hc_eps: float):
    """The streams x [B, T, n, D] as one [B, T, D]: weighted by sigmoids of a linear map of the normed streams."""
    mixes = F.linear(unweighted_rms(x.flatten(2).float(), eps), fn.float())
    pre = torch.sigmoid(mixes * scale.float() + base.float()) + hc_eps
    return (pre.unsqueeze(-1) * x).sum(dim=2).to(x.dtype)


class HyperConnectedDecoder(Decoder):
    """The embedding copied into every stream; the streams collapsed by the head's weights, then normed.
    Each attention rotates by tables of its own, and the token ids travel in the context."""

    def __init__(self, c: ModelConfig, layers: list[DecoderLayer]):
        super().__init__(c, layers)
        self.streams = c.own.hc_mult
        self.norm = Norm(c.hidden_size, c.rms_norm_eps)
        self.hc_head = HyperHead(c)
        self.rotary = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids).unsqueeze(2).expand(-1, -1, self.streams, -1).contiguous()

    def first_carried(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        return {TOKENS: input_ids}

    def final(self, x: torch.Tensor, snapshots: list[torch.Tensor]) -> torch.Tensor:
        return self.norm(self.hc_head(x))


class DeepseekV4ForCausalLM(CausalLM):
    """The decoder and the head, `head.weight` as both spellings name it."""

    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        layers = [HyperConnectedLayer(c, i, expert_range) for i in range(c.num_layers)]
        super().__init__(c, layers, decoder=HyperConnectedDecoder)
        self.lm_head = None
        self.head = Linear(c.hidden_size, c.vocab_size)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return linear(h, self.head.weight)


class DeepseekV4MTP(HyperConnectedLayer):
    """One multi-token-prediction layer (the release's `mtp.K.`), as DeepSeek's inference code
    (`MTPBlock`) and vLLM's deepseek_v4_mtp.py run it: a decoder layer of the MTP layers' kind
    (`kind(num_hidden_layers)`, routed by score) on the hidden streams of the layer before,
    each normed (`hnorm`) and projected (`h_proj`), plus the next token's embedding (the model's
    own, held apart in `decoder_parts` as the loader fills it from the decoder's tensors) normed
    (`enorm`) and projected (`e_proj`). Its logits are the model's head on its streams collapsed by
    its own `hc_head_*` and normed by its `norm`."""

    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        super().__init__(c, c.num_layers, expert_range)
        D, eps, n = c.hidden_size, c.rms_norm_eps, c.own.hc_mult
        DecoderParts(c).held_by(self)
        self.enorm, self.hnorm, self.norm = Norm(D, eps), Norm(D, eps), Norm(D, eps)
        self.e_proj, self.h_proj = Linear(D, D), Linear(D, D)
        self.hc_head_fn = nn.Parameter(torch.empty(n, n * D))
        self.hc_head_base = nn.Parameter(torch.empty(n))
        self.hc_head_scale = nn.Parameter(torch.empty(1))

    def mtp_input(self, input_ids: torch.Tensor, hidden: torch.Tensor, shift: int = 1) -> torch.Tensor:
        """The decoder layer's input streams [B, T, n, D] for sequences `input_ids` [B, T] whose last
        decoder layer (or previous MTP layer) left the streams `hidden` [B, T, n, D] (before the
        head's collapse): at position t, h_proj(hnorm(hidden[t])) + e_proj(enorm(embed(token[t +
        shift]))) in every stream (MTP layer k predicts with shift k + 1; zero past the sample's end)."""
        emb = self.e_proj(self.enorm(tokens_ahead(self.decoder_parts.embed_tokens, input_ids, shift)))
        return self.h_proj(self.hnorm(hidden)) + emb.unsqueeze(2)

    def final(self, x: torch.Tensor) -> torch.Tensor:
        """What the model's head reads of the layer's output streams x [B, T, n, D]."""
        c = self.config
        return self.norm(
            collapse(x, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, c.rms_norm_eps, c.own.hc_eps)
        )
