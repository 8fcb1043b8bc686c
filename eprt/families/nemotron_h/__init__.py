"""Nemotron-H / Nemotron-3 (`nemotron_h`) and the language model of Nemotron-H-Omni (`nemotron_h_omni`).
Config: config.py; tensors: layout.py; model: model.py."""

from __future__ import annotations

from eprt.families.family import COMMON_UNQUANTIZED, Family, language_model_of
from eprt.families.kimi_k25.layout import under_language_model
from eprt.families.nemotron_h import config, layout, model, mtp

FAMILY = Family(
    config.FAMILY,
    (config.FAMILY,),
    config.parse,
    layout.layout,
    model.NemotronHForCausalLM,
    # transformers keeps the router's weight and correction bias in fp32; vLLM's MambaMixer2 holds
    # A (from A_log), D and dt_bias in fp32
    fp32=(
        r".*\.mixer\.gate\.weight",
        r".*\.e_score_correction_bias",
        r".*\.mixer\.(A_log|D|dt_bias)",
    ),
    # vLLM builds the router (GateLinear) unquantized; Mamba's conv1d, A_log, D, dt_bias and its
    # gated norm are no Linears; in_proj, out_proj and the latent projections load quantized. The
    # MTP step's eh_proj stays in the source dtype, as every family's (eprt-check holds an MTP
    # eh_proj unquantized: SGLang builds DeepSeek's as a plain Linear)
    unquantized=(
        *COMMON_UNQUANTIZED,
        rf"{layout.DECODER}\.(embed_tokens|embeddings)",
        r".*\.mixer\.gate",
        r"mtp\.layers\.\d+\.eh_proj",
    ),
    # its attention is a layer's `mixer` (no other mixer has q/k/v/o projections): the recipes'
    # `*.self_attn.*` names it too
    recipe_aliases=((r"(.*\.)mixer\.([qkvo]_proj)", r"\1self_attn.\2"),),
    mtp_model=mtp.NemotronHMTP,
    mtp_prefix=mtp.step_prefix,
)
OMNI_FAMILY = language_model_of(
    FAMILY,
    under_language_model,
    name=config.OMNI_FAMILY,
    model_types=(config.OMNI_FAMILY,),
    parse=config.parse_omni,
    tensors=layout.omni_layout,
    model=model.NemotronHOmni,
    mtp_model=mtp.NemotronHMTP,
)
