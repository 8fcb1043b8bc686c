"""Kimi-Linear (and Kimi-K3's language model): the Hugging Face tensor layout, the checkpoint's tensors as eprt reads and writes them."""

from __future__ import annotations

from eprt.config import ModelConfig
from eprt.layout import Layout, TensorSpec, decoder_specs, gated_mlp, mla_attention, plain, stacked_experts


def layout(c: ModelConfig) -> Layout:
    k, D = c.kimi_linear, c.hidden_size
    final = ()
    if k.attn_res_block_size:
        final = (plain("model.output_attn_res_norm.weight", D), plain("model.output_attn_res_proj.weight", 1, D))
    return Layout(tuple(decoder_specs(c, lambda p, i: layer(c, p, i), final)))


def layer(c: ModelConfig, p: str, i: int) -> list[TensorSpec]:
    """Decoder layer i's tensors after its two norms: the attention residuals' queries, KDA or MLA, the MLP."""
    k, kda = c.kimi_linear, c.kimi_linear.kda
    D, H = c.hidden_size, c.num_heads
    width, d = kda.heads * kda.head_dim, kda.head_dim  # KDA's q/k/v width over all heads, one head's
    a = f"{p}.self_attn"
    specs = []
    for r in ["self_attention_res", "mlp_res"] if k.attn_res_block_size else []:
        specs += [plain(f"{p}.{r}_norm.weight", D), plain(f"{p}.{r}_proj.weight", 1, D)]
    if i in kda.layers:
        specs += [plain(f"{a}.{n}_proj.weight", width, D) for n in "qkv"]
        specs += [plain(f"{a}.{n}_conv1d.weight", width, 1, kda.conv_kernel) for n in "qkv"]
        specs += [
            a_log(f"{a}.A_log", kda.a_log_shape),
            plain(f"{a}.dt_bias", width),
            plain(f"{a}.f_a_proj.weight", d, D),
            plain(f"{a}.f_b_proj.weight", width, d),
            plain(f"{a}.b_proj.weight", kda.heads, D),
        ]
        if kda.full_rank_gate:
            specs.append(plain(f"{a}.g_proj.weight", width, D))
        else:
            specs += [plain(f"{a}.g_a_proj.weight", d, D), plain(f"{a}.g_b_proj.weight", width, d)]
        specs += [plain(f"{a}.o_norm.weight", d), plain(f"{a}.o_proj.weight", D, width)]
    else:
        specs += mla_attention(a, c)
        if k.mla_output_gate:
            specs.append(plain(f"{a}.g_proj.weight", H * c.mla.v_head_dim, D))
    if not c.is_moe(i):
        # transformers 5 saves a dense layer's MLP under the MoE layers' name
        return specs + gated_mlp(f"{p}.mlp", D, c.intermediate_size, alias=f"{p}.block_sparse_moe")
    m, moe = f"{p}.block_sparse_moe", c.moe
    latent = c.own  # LatentExperts, where the experts compute in a latent
    specs += [
        plain(f"{m}.gate.weight", moe.num_experts, D),
        plain(f"{m}.gate.e_score_correction_bias", moe.num_experts),
    ]
    specs += stacked_experts(f"{m}.experts", moe.num_experts, moe.intermediate_size, c.routed_width, "w1", "w3", "w2")
    if moe.num_shared_experts:
        specs += gated_mlp(f"{m}.shared_experts", D, moe.intermediate_size * moe.num_shared_experts)
    if latent:
        Z = latent.latent_size
        specs += [plain(f"{m}.routed_expert_down_proj.weight", Z, D), plain(f"{m}.routed_expert_up_proj.weight", D, Z)]
        if latent.latent_norm:
            specs.append(plain(f"{m}.routed_expert_norm.weight", Z))
    return specs


def a_log(name: str, shape: tuple[int, ...]) -> TensorSpec:
    """Kimi-Linear's A_log is [1, 1, heads, 1] exactly (transformers and mlx-lm load no other
    shape). Kimi-K3's is a vector whose first entries are the heads' and the rest padding (128
    entries for 96 heads in the release): mlx-lm and SGLang read the first `heads` of any length."""
    if len(shape) > 1:
        return plain(name, *shape)
    return TensorSpec(name, shape, (name,), padded_per="KDA head")
