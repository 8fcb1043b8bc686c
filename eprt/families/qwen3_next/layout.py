"""Qwen3-Next: the Hugging Face tensor layout, the checkpoint's tensors as eprt reads and writes them."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.layout import Layout, TensorSpec, decoder_specs, gated_mlp, gqa_attention, plain, stacked_experts


def gated_delta_net(prefix: str, c: ModelConfig) -> list[TensorSpec]:
    g, D = c.qwen_next.gated_delta_net, c.hidden_size
    keys, values = g.key_heads * g.key_head_dim, g.value_heads * g.value_head_dim  # widths of all heads
    if g.split_projections:
        specs = [
            plain(f"{prefix}.in_proj_qkv.weight", 2 * keys + values, D),
            plain(f"{prefix}.in_proj_z.weight", values, D),
            plain(f"{prefix}.in_proj_b.weight", g.value_heads, D),
            plain(f"{prefix}.in_proj_a.weight", g.value_heads, D),
        ]
    else:
        specs = [
            plain(f"{prefix}.in_proj_qkvz.weight", 2 * keys + 2 * values, D),
            plain(f"{prefix}.in_proj_ba.weight", 2 * g.value_heads, D),
        ]
    return specs + [
        plain(f"{prefix}.conv1d.weight", 2 * keys + values, 1, g.conv_kernel),
        plain(f"{prefix}.dt_bias", g.value_heads),
        plain(f"{prefix}.A_log", g.value_heads),
        plain(f"{prefix}.norm.weight", g.value_head_dim),
        plain(f"{prefix}.out_proj.weight", D, values),
    ]


def layout(c: ModelConfig) -> Layout:
    D = c.hidden_size

    def layer(p: str, i: int) -> list[TensorSpec]:
        if i in c.qwen_next.gated_delta_net.layers:
            specs = gated_delta_net(f"{p}.linear_attn", c)
        else:
            specs = gqa_attention(f"{p}.self_attn", c)
        if not c.is_moe(i):
            return specs + gated_mlp(f"{p}.mlp", D, c.intermediate_size)
        specs += [plain(f"{p}.mlp.gate.weight", c.moe.num_experts, D)]
        specs += stacked_experts(
            f"{p}.mlp.experts", c.moe.num_experts, c.moe.intermediate_size, D, "gate_proj", "up_proj", "down_proj"
        )
        specs += gated_mlp(f"{p}.mlp.shared_expert", D, c.qwen_next.shared_expert_intermediate_size)
        return specs + [plain(f"{p}.mlp.shared_expert_gate.weight", 1, D)]

    return Layout(tuple(decoder_specs(c, layer)))
