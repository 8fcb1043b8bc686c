"""The family table: every `model_type` eprt reads, and all eprt knows of its family, in one entry.

A family is one folder, `eprt/families/<name>/` (docs/adding-a-family.md): its config reader,
its tensor layout, its model, and its entry (`FAMILY`, eprt.families.family.Family), registered
here in one line of FAMILIES. The table is listed, not discovered: the imports say
which folders are families (the import graph's test sees them), and a folder being written is
not picked up half done.

The table sits above the model code (each entry names its model class); what a run needs of it
(the layout, the tensors kept in fp32, the model class) it resolves once (eprt.loading.resolved).
"""

from __future__ import annotations

import os
import re

from eprt.config import ModelConfig
from eprt.errors import ConfigError
from eprt.families import (
    deepseek_v3,
    deepseek_v4,
    deepseek_v32,
    glm4_moe,
    glm_moe_dsa,
    gpt_oss,
    kimi_k3,
    kimi_k25,
    kimi_linear,
    kimi_vl,
    llama4,
    minimax_m2,
    minimax_m3_vl,
    mistral4,
    nemotron_h,
    qwen3_5_moe,
    qwen3_moe,
    qwen3_next,
)
from eprt.families.family import Family
from eprt.storage.bounded import read_json_object
from eprt.storage.hf_files import CONFIG

FAMILIES: tuple[Family, ...] = (
    qwen3_moe.FAMILY,
    deepseek_v3.FAMILY,
    glm4_moe.FAMILY,
    deepseek_v32.FAMILY,
    glm_moe_dsa.FAMILY,
    kimi_linear.FAMILY,
    kimi_k25.FAMILY,
    kimi_vl.FAMILY,
    kimi_k3.FAMILY,
    qwen3_next.FAMILY,
    qwen3_5_moe.TEXT_FAMILY,
    qwen3_5_moe.FAMILY,
    mistral4.FAMILY,
    mistral4.VLM_FAMILY,
    minimax_m2.FAMILY,
    minimax_m3_vl.TEXT_FAMILY,
    minimax_m3_vl.FAMILY,
    llama4.TEXT_FAMILY,
    llama4.FAMILY,
    nemotron_h.FAMILY,
    nemotron_h.OMNI_FAMILY,
    gpt_oss.FAMILY,
    deepseek_v4.FAMILY,
)
_BY_MODEL_TYPE = {mt: f for f in FAMILIES for mt in f.model_types}
# Every family's other names of its modules: each names modules no other family has (Nemotron-H's
# attention `mixer.q_proj`), so they apply to a module name of any family.
_RECIPE_ALIASES = tuple(dict.fromkeys((re.compile(p), r) for f in FAMILIES for p, r in f.recipe_aliases))


def recipe_names(module: str) -> tuple[str, ...]:
    """`module` and the other names a recipe's patterns match it by (Family.recipe_aliases)."""
    return (module, *(p.sub(r, module) for p, r in _RECIPE_ALIASES if p.fullmatch(module)))


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


def model_class(c: ModelConfig) -> type:
    """The model class that runs `c`: Class(c, expert_range=None)."""
    return reader_for(c.model_type, c.family).model
