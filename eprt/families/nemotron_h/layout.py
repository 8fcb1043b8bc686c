"""Nemotron-H's tensors as released and as transformers 5 saves them (the same names): `backbone.layers.N`
holds one `norm` and one `mixer` (Mamba-2, attention, MLP or MoE), the routed experts stored per expert
(`mixer.experts.E.{up,down}_proj`, not gated) or fused as transformers holds them (`mixer.experts.up_proj`
[E, I, D], `down_proj` [E, D, I]); the embeddings `backbone.embeddings` and the final norm
`backbone.norm_f`, which eprt's decoder names `embed_tokens` and `norm` (the export writes the
release's names back). The multi-token-prediction layers (`mtp.layers.N`) are carried through convert
under their names, and run and quantized under a recipe's `mtp: true` (`Layout.mtp`).
The Omni VLM holds all of it under `language_model.` beside its vision and audio towers."""

from __future__ import annotations

import dataclasses

from eprt.config import ModelConfig
from eprt.families.kimi_k25 import layout as kimi_k25
from eprt.families.nemotron_h.config import ATTENTION, MAMBA, MLP, NemotronHConfig
from eprt.layout import ExpertPieces, Layout, TensorSpec, gqa_attention, plain, stacked_experts

RELU2_EXPERTS = ExpertPieces(gated=False, activation="relu2")
DECODER = "backbone"
MTP = (r"mtp\..+",)
# The Omni release's towers and projectors beside the language model (and transformers 5's names of them)
TOWERS = (
    r"vision_model\..+",
    r"mlp1\..+",
    r"vision_projector\..+",
    r"sound_encoder\..+",
    r"sound_projection\..+",
    r"multi_modal_projector\..+",
    r"vision_final_layernorm\..+",
    r"audio_tower\..+",
    r"embed_audio\..+",
)


def renamed(name: str, release_name: str, *shape: int) -> TensorSpec:
    """A tensor eprt's decoder names `name` and the release `release_name`, read and written back as that."""
    return TensorSpec(name, tuple(shape), (release_name,))


def mamba2(prefix: str, c: ModelConfig) -> list[TensorSpec]:
    m, D = c.own.mamba, c.hidden_size
    inner = m.heads * m.head_dim
    specs = [
        plain(f"{prefix}.in_proj.weight", inner + m.conv_dim + m.heads, D),
        plain(f"{prefix}.conv1d.weight", m.conv_dim, 1, m.conv_kernel),
    ]
    if m.conv_bias:
        specs.append(plain(f"{prefix}.conv1d.bias", m.conv_dim))
    return specs + [
        plain(f"{prefix}.dt_bias", m.heads),
        plain(f"{prefix}.A_log", m.heads),
        plain(f"{prefix}.D", m.heads),
        plain(f"{prefix}.norm.weight", inner),
        plain(f"{prefix}.out_proj.weight", D, inner),
    ]


def relu2_mlp(prefix: str, hidden: int, width: int) -> list[TensorSpec]:
    return [plain(f"{prefix}.up_proj.weight", width, hidden), plain(f"{prefix}.down_proj.weight", hidden, width)]


def moe(prefix: str, c: ModelConfig) -> list[TensorSpec]:
    own: NemotronHConfig = c.own
    m, D = c.moe, c.hidden_size
    specs = [
        plain(f"{prefix}.gate.weight", m.num_experts, D),
        plain(f"{prefix}.gate.e_score_correction_bias", m.num_experts),
    ]
    specs += stacked_experts(
        f"{prefix}.experts", m.num_experts, m.intermediate_size, c.routed_width, None, pieces=RELU2_EXPERTS
    )
    specs += relu2_mlp(f"{prefix}.shared_experts", D, own.shared_intermediate_size)
    if own.latent_size:
        specs += [
            plain(f"{prefix}.fc1_latent_proj.weight", own.latent_size, D),
            plain(f"{prefix}.fc2_latent_proj.weight", D, own.latent_size),
        ]
    return specs


def block(prefix: str, kind: str, c: ModelConfig) -> list[TensorSpec]:
    """One layer: its norm and its mixer of `kind`."""
    mixer = f"{prefix}.mixer"
    if kind == MAMBA:
        specs = mamba2(mixer, c)
    elif kind == ATTENTION:
        specs = gqa_attention(mixer, c)
    elif kind == MLP:
        specs = relu2_mlp(mixer, c.hidden_size, c.intermediate_size)
    else:
        specs = moe(mixer, c)
    return [plain(f"{prefix}.norm.weight", c.hidden_size), *specs]


def layout(c: ModelConfig) -> Layout:
    D = c.hidden_size
    specs = [renamed(f"{DECODER}.embed_tokens.weight", f"{DECODER}.embeddings.weight", c.vocab_size, D)]
    for i, kind in enumerate(c.own.layer_kinds):
        specs += block(f"{DECODER}.layers.{i}", kind, c)
    specs.append(renamed(f"{DECODER}.norm.weight", f"{DECODER}.norm_f.weight", D))
    if not c.tie_word_embeddings:
        specs.append(plain("lm_head.weight", c.vocab_size, D))
    # a checkpoint converted before eprt ran the step says no MTP layer: it carries them only
    return Layout(tuple(specs), passthrough=MTP, mtp=tuple(mtp_layers(c)) if c.num_nextn_predict_layers else ())


def mtp_layers(c: ModelConfig, prefix: str = "") -> list[TensorSpec]:
    """The multi-token-prediction layers (`Layout.mtp`; convert carries them as `passthrough`), as
    vLLM's NemotronHMTP loads them: one block per kind of `mtp_layers_block_type` (`mtp.layers.K.norm` and `.mixer`), the
    first also joining the embedding and the hidden state (`enorm`, `hnorm`, `eh_proj`), the last
    normalizing its output (`final_layernorm`); the embeddings and head are the model's."""
    D, kinds = c.hidden_size, c.own.mtp_layer_kinds
    specs = []
    for k, kind in enumerate(kinds):
        p = f"{prefix}mtp.layers.{k}"
        if k == 0:
            specs += [
                plain(f"{p}.enorm.weight", D),
                plain(f"{p}.hnorm.weight", D),
                plain(f"{p}.eh_proj.weight", D, 2 * D),
            ]
        specs += block(p, kind, c)
        if k == len(kinds) - 1:
            specs.append(plain(f"{p}.final_layernorm.weight", D))
    return specs


def omni_layout(c: ModelConfig) -> Layout:
    """The Omni VLM: the text layout under `language_model.`, the towers and projectors carried."""
    text = layout(c)
    return dataclasses.replace(
        kimi_k25.vlm_layout(text),
        passthrough=(*kimi_k25.under_language_model(text.passthrough), *TOWERS),
        mtp=tuple(mtp_layers(c, kimi_k25.PREFIX)) if c.num_nextn_predict_layers else (),
    )
