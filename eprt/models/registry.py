"""Which model class runs each eprt family (ModelConfig.family)."""

from __future__ import annotations

from eprt.errors import ConfigError

_MODELS: dict[str, type] = {}


def register_model(family: str):
    def add(cls: type) -> type:
        _MODELS[family] = cls
        return cls
    return add


def model_class(family: str) -> type:
    # Importing the family files registers them.
    from eprt.models import deepseek_v3, kimi_k3, kimi_k25, kimi_linear, qwen3_5_moe, qwen3_moe, qwen3_next  # noqa: F401

    if family not in _MODELS:
        raise ConfigError(f"no model code for family {family!r}; eprt runs {', '.join(sorted(_MODELS))}")
    return _MODELS[family]
