"""The family table: every `model_type` eprt reads, and all eprt knows of its family, in one entry.

Adding a family is adding its reader (`eprt/families/<name>.py`: `parse` a config.json, the
tensor `layout`), one entry in FAMILIES, and its model code (`eprt/models/<name>.py`) with its
class in eprt.models.registry. The table sits below the model code, which asks it nothing: what
a run needs of the table (the layout, the tensors kept in fp32) it resolves once
(eprt.models.resolved).
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from eprt.config import ModelConfig
from eprt.errors import ConfigError
from eprt.families import (
    deepseek_v3,
    deepseek_v32,
    glm4_moe,
    kimi_k3,
    kimi_k25,
    kimi_linear,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from eprt.layout import Layout
from eprt.storage.bounded import read_json_object
from eprt.storage.hf_files import CONFIG

# Modules no recipe quantizes, in every family: the engines build them unquantized.
COMMON_UNQUANTIZED = (r"model\.embed_tokens", r"lm_head", r".*\.mlp\.gate")


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    model_types: tuple[str, ...]  # the config.json `model_type`s it reads
    parse: Callable[[dict, str], ModelConfig]  # (config.json, its path for messages) -> ModelConfig
    tensors: Callable[[ModelConfig], Layout]  # the tensor layout: specs and what is only carried through
    # Regexes over tensor names the reference keeps in fp32 whatever the model dtype: the model
    # holds them in fp32, and a `--dtype` conversion leaves them in their source dtype.
    fp32: tuple[str, ...] = ()
    unquantized: tuple[str, ...] = COMMON_UNQUANTIZED  # regexes over module names no recipe quantizes

    def layout(self, c: ModelConfig) -> Layout:
        return replace(self.tensors(c), precise=self.fp32, unquantized=self.unquantized)

    def keeps_fp32(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.fp32)


def language_model_of(text: Family, name: str, model_types: tuple[str, ...], parse, tensors) -> Family:
    """A vision-language family whose language model is `text`'s, under `language_model.`."""
    under = kimi_k25.under_language_model
    return Family(name, model_types, parse, tensors, fp32=under(text.fp32), unquantized=under(text.unquantized))


QWEN3_MOE = Family("qwen3_moe", ("qwen3_moe",), qwen3_moe.parse, qwen3_moe.layout)
DEEPSEEK_V3 = Family(
    "deepseek_v3",
    ("deepseek_v3", "kimi_k2"),
    deepseek_v3.parse,
    deepseek_v3.layout,
    # the router computes in fp32, with its correction bias
    fp32=(r".*\.mlp\.gate\.weight", r".*\.e_score_correction_bias"),
    # an MTP layer's own embedding and head are an embedding and an lm_head; vLLM and SGLang build
    # its eh_proj as a plain torch Linear, which cannot load a quantized weight
    unquantized=(*COMMON_UNQUANTIZED, r".*\.embed_tokens", r".*\.shared_head\.head", r".*\.eh_proj"),
)
GLM4_MOE = Family(
    "glm4_moe",
    ("glm4_moe",),
    glm4_moe.parse,
    glm4_moe.layout,
    fp32=DEEPSEEK_V3.fp32,
    unquantized=DEEPSEEK_V3.unquantized,
)  # DeepSeek-V3's router and MTP layer
DEEPSEEK_V32 = Family(
    "deepseek_v32",
    ("deepseek_v32",),
    deepseek_v32.parse,
    deepseek_v32.layout,
    fp32=DEEPSEEK_V3.fp32,  # DeepSeek-V3's router
    # The lightning indexer's projections stay unquantized in every recipe: vLLM fuses `wk` with
    # `weights_proj` into one unquantized Linear (a block-FP8 `wk` is upcast to bf16 as it loads)
    # and both vLLM and SGLang build `weights_proj` without a quantization config; `wq_b` is
    # excluded with them, so that each engine loads the whole indexer as the source held it.
    unquantized=(*COMMON_UNQUANTIZED, r".*\.self_attn\.indexer\.(wq_b|wk|weights_proj)"),
)
# GLM-5's and Kimi-VL's family folders build their entries from DeepSeek-V3.2's and DeepSeek-V3's,
# so they come in once those are defined
from eprt.families import glm_moe_dsa, kimi_vl  # noqa: E402

KIMI_LINEAR = Family(
    "kimi_linear",
    ("kimi_linear",),
    kimi_linear.parse,
    kimi_linear.layout,
    # the router, its correction bias and KDA's decay parameters compute in fp32
    fp32=(
        r".*\.block_sparse_moe\.gate\.weight",
        r".*\.e_score_correction_bias",
        r".*\.self_attn\.A_log",
        r".*\.self_attn\.dt_bias",
    ),
    # the engines build these unquantized (docs/export.md, 'Exclusions'): the router, the latent
    # projections of the routed experts, the attention-residual queries
    unquantized=(
        *COMMON_UNQUANTIZED,
        r".*\.block_sparse_moe\.gate",
        r".*\.routed_expert_(down|up)_proj",
        r".*_res_proj",
    ),
)
KIMI_K25 = language_model_of(DEEPSEEK_V3, "kimi_k25", ("kimi_k25",), kimi_k25.parse, kimi_k25.layout)
KIMI_K3 = language_model_of(KIMI_LINEAR, "kimi_k3", ("kimi_k3",), kimi_k3.parse, kimi_k3.layout)
QWEN3_NEXT = Family(
    "qwen3_next",
    ("qwen3_next",),
    qwen3_next.parse,
    qwen3_next.layout,
    # vLLM builds these without quantization: the shared expert's gate (one output) and the linear
    # attention's b/a projections (merged into in_proj_ba, quant_config=None); conv1d is no Linear.
    unquantized=(*COMMON_UNQUANTIZED, r".*\.mlp\.shared_expert_gate", r".*\.linear_attn\.in_proj_(ba|b|a)"),
)
# Qwen3.5-MoE's language model saved alone: Qwen3-Next's model, projections stored apart, MTP carried
QWEN3_5_MOE_TEXT = Family(
    "qwen3_5_moe_text",
    ("qwen3_5_moe_text",),
    qwen3_5_moe.parse_text,
    qwen3_5_moe.text_layout,
    unquantized=QWEN3_NEXT.unquantized,
)
# Qwen3.5-MoE as released: that language model under `model.language_model.`, the vision tower carried
QWEN3_5_MOE = Family(
    "qwen3_5_moe",
    ("qwen3_5_moe",),
    qwen3_5_moe.parse,
    qwen3_5_moe.layout,
    unquantized=qwen3_5_moe.patterns_under_language_model(QWEN3_NEXT.unquantized),
)

FAMILIES = (
    QWEN3_MOE,
    DEEPSEEK_V3,
    GLM4_MOE,
    DEEPSEEK_V32,
    glm_moe_dsa.FAMILY,
    KIMI_LINEAR,
    KIMI_K25,
    kimi_vl.FAMILY,
    KIMI_K3,
    QWEN3_NEXT,
    QWEN3_5_MOE_TEXT,
    QWEN3_5_MOE,
)
_BY_MODEL_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}


def supported_model_types() -> list[str]:
    return sorted(_BY_MODEL_TYPE)


def reader_for(model_type: str, source: str) -> Family:
    """The family that reads `model_type` (a config.json's, named `source` in the error)."""
    if model_type not in _BY_MODEL_TYPE:
        raise ConfigError(
            f"{source}: model_type {model_type!r} is not supported; eprt reads {', '.join(supported_model_types())}"
        )
    return _BY_MODEL_TYPE[model_type]


def read_hf_config(hf_dir: str) -> dict:
    path = os.path.join(hf_dir, CONFIG)
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: missing; a Hugging Face checkpoint directory holds a {CONFIG}")
    return read_json_object(path, f"a {CONFIG} is a UTF-8 JSON object of fields")


def parse_hf_config(hf: dict, source: str = CONFIG) -> ModelConfig:
    """The normalized config of a Hugging Face config.json (already loaded)."""
    if "model_type" not in hf:
        raise ConfigError(f"{source}: no model_type; cannot tell which family this is")
    return reader_for(hf["model_type"], source).parse(hf, source)


def load_hf_config(hf_dir: str) -> tuple[dict, ModelConfig]:
    hf = read_hf_config(hf_dir)
    return hf, parse_hf_config(hf, os.path.join(hf_dir, CONFIG))
