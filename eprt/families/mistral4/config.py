"""Mistral-Small-4's config.json -> ModelConfig: DeepSeek-V3's MLA sizes, a softmax router with
expert groups and no correction bias, YaRN, and Llama-4's query temperature, the one knob only
this family has (`Mistral4Config`). `mistral4` is the language model saved alone; the release is
the vision-language checkpoint (`mistral3` whose `text_config` is `mistral4`: `mistral4_vlm`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from eprt.config import (
    FamilyConfig,
    ModelConfig,
    moe_or_dense,
    own_config,
    read_expert_groups,
    read_rope,
    require_silu,
)
from eprt.config_fields import Fields, vlm_text_config
from eprt.families.deepseek_v3 import config as deepseek_v3

FAMILY, VLM_FAMILY = "mistral4", "mistral4_vlm"

# What transformers 5.25's Mistral4Config assumes where config.json has no rope_parameters.
DEFAULT_ROPE = {
    "type": "yarn",
    "rope_theta": 10000.0,
    "factor": 128.0,
    "original_max_position_embeddings": 8192,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


@own_config(FAMILY, VLM_FAMILY)
@dataclass(frozen=True)
class Mistral4Config(FamilyConfig):
    """Llama-4's attention temperature: the query at position t is scaled by
    1 + beta * log(1 + floor(t / positions)) (eprt.models.rope.llama4_attention_scale)."""

    temperature_beta: float
    temperature_positions: int


def parse(hf: dict, source: str) -> ModelConfig:
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        hf = {**hf, "rope_parameters": DEFAULT_ROPE}
    f = Fields(hf, source)
    n_layers = f.get("num_hidden_layers")
    deepseek_v3.refuse_other_mla(f, "Mistral-Small-4")
    require_silu(f, "Mistral-Small-4")
    n_heads = deepseek_v3.read_mla_heads(f)
    n_experts = f.get("n_routed_experts", "num_local_experts", default=128)
    n_group, topk_group = read_expert_groups(f, n_experts)
    rope = read_rope(f)
    first_dense = f.get("first_k_dense_replace", default=0) or 0
    return ModelConfig(
        family=FAMILY,
        model_type=hf["model_type"],
        vocab_size=f.get("vocab_size"),
        hidden_size=f.get("hidden_size"),
        num_layers=n_layers,
        num_heads=n_heads,
        rms_norm_eps=float(f.get("rms_norm_eps", default=1e-6)),
        tie_word_embeddings=bool(f.get("tie_word_embeddings", default=False)),
        intermediate_size=f.get("intermediate_size", default=12288),
        max_position_embeddings=f.get("max_position_embeddings", default=1048576),
        rope=rope,
        mla=deepseek_v3.read_mla(f),
        moe=moe_or_dense(
            (i for i in range(n_layers) if i >= first_dense and n_experts > 0),
            num_experts=n_experts,
            num_experts_per_tok=f.experts_per_token(n_experts, "num_experts_per_tok", default=4),
            intermediate_size=f.get("moe_intermediate_size", default=2048),
            num_shared_experts=f.get("n_shared_experts", default=1),
            router="softmax",
            norm_topk_prob=bool(f.get("norm_topk_prob", default=True)),
            routed_scaling_factor=float(f.get("routed_scaling_factor", default=1.0)),
            n_group=n_group,
            topk_group=topk_group,
        ),
        own=read_temperature(f, rope),
    )


def read_temperature(f: Fields, rope) -> Mistral4Config:
    """Llama-4's temperature from the rope parameters, as the reference reads them: its beta
    `llama_4_scaling_beta`, its span YaRN's `original_max_position_embeddings`."""
    params = {**(f.get("rope_parameters", default=None) or {}), **(f.get("rope_scaling", default=None) or {})}
    beta = params.get("llama_4_scaling_beta")
    if beta is None or rope.yarn is None:
        raise f.refuse(
            "rope parameters without llama_4_scaling_beta and YaRN's original_max_position_embeddings: "
            "Mistral-Small-4 scales its queries by Llama-4's temperature, which needs both (the "
            "reference fails without them); give them in rope_parameters"
        )
    # read_rope has checked beta as a number
    return Mistral4Config(float(beta), rope.yarn.original_max_position_embeddings)


def parse_vlm(hf: dict, source: str) -> ModelConfig:
    """The release's config.json: Mistral3's vision-language wrapper around a `mistral4` text_config."""
    text = vlm_text_config(hf, source)
    if text.get("model_type") != FAMILY:
        raise Fields(hf, source).refuse(
            f"text_config.model_type is {text.get('model_type')!r}: eprt reads the mistral3 checkpoints whose "
            f"language model is {FAMILY} (Mistral-Small-4), not Mistral-Small-3's dense one"
        )
    return dataclasses.replace(parse(text, f"{source} (text_config)"), family=VLM_FAMILY, model_type=hf["model_type"])
