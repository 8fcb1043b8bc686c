"""Rotary position embeddings: default and YaRN frequencies, rotate-half and interleaved application.

The frequencies follow transformers' `modeling_rope_utils` for the same config fields, so the
cos/sin tables are the reference's to the last bit: computed in fp32 on the CPU, scaled by the
YaRN attention factor, rounded to the activation dtype.
"""

from __future__ import annotations

import math

import torch

from eprt.config import YarnConfig


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_frequencies(
    dim: int, theta: float, scaling: YarnConfig | None, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2] fp32, attention factor that scales cos and sin)."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device="cpu") / dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    orig = scaling.original_max_position_embeddings
    factor = scaling.factor or max_position_embeddings / orig
    attention_factor = scaling.attention_factor
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.mscale, scaling.mscale_all_dim
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)
    beta_fast = scaling.beta_fast or 32
    beta_slow = scaling.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # the reference's guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation_weight) + 1.0 / pos_freqs * extrapolation_weight
    return inv_freq, float(attention_factor)


def llama3_frequencies(
    inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float, original: int
) -> torch.Tensor:
    """Llama-3's scaling of default frequencies (transformers' `llama3` rope type): wavelengths longer
    than original / low_freq_factor slowed by `factor`, shorter than original / high_freq_factor kept,
    those between interpolated smoothly."""
    low_wavelen, high_wavelen = original / low_freq_factor, original / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    # (the reference divides by zero here where low == high; no frequency then takes the smoothed value)
    smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_softmax_scale(scaling: YarnConfig | None) -> float:
    """DeepSeek's extra factor on the attention softmax scale under YaRN: mscale(factor, mscale_all_dim)^2."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


class Rotary:
    """cos/sin tables [T, dim] (each frequency twice, [f | f]) for positions 0..T-1."""

    def __init__(self, dim: int, theta: float, scaling: YarnConfig | None, max_position_embeddings: int):
        self.inv_freq, self.attention_factor = rope_frequencies(dim, theta, scaling, max_position_embeddings)

    def __call__(self, seq_len: int, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
        positions = torch.arange(seq_len, device=device, dtype=torch.float32)
        freqs = positions[:, None] * self.inv_freq.to(device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_factor).to(dtype), (emb.sin() * self.attention_factor).to(dtype)


def rope_rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX style (Qwen3): dimension i pairs with i + d/2, d = cos.shape[-1]. Partial rotary
    (GLM-4.5, DeepSeek-V3.2's indexer, Qwen3-Next): when d is less than x's last dim, only the leading d
    dims rotate and the rest pass through."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return torch.cat((rope_rotate_half(x[..., :d], cos, sin), x[..., d:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """DeepSeek style: pairs (x0, x1), (x2, x3), ... rotate together. The result comes out
    de-interleaved ([rotated evens | rotated odds]), as in the reference; q and k get the same
    permutation, so their dot products are unchanged. Partial rotary (GLM-5's indexer): when
    cos.shape[-1] is less than x's last dim, only the leading dims rotate and the rest pass through."""
    d = cos.shape[-1]
    if d < x.shape[-1]:
        return torch.cat((rope_interleaved(x[..., :d], cos, sin), x[..., d:]), dim=-1)
    half = d // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def llama4_attention_scale(seq_len: int, beta: float, positions: int, dtype: torch.dtype, device) -> torch.Tensor:
    """Llama-4's attention temperature (Mistral-Small-4): the query at position t times
    1 + beta * log(1 + floor(t / positions)), [T, 1] in fp32 rounded to `dtype` as the reference
    rounds it; 1 within the first `positions` tokens, growing with each further span of them."""
    t = torch.arange(seq_len, device=device)
    return (1 + beta * torch.log(1 + torch.floor(t / positions)))[:, None].to(dtype)
