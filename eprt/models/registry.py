"""The model class that runs each eprt family (ModelConfig.family): Class(config, expert_range=None)."""

from __future__ import annotations

from torch import nn

from eprt.errors import ConfigError
from eprt.families.glm_moe_dsa.model import GlmMoeDsaForCausalLM
from eprt.models.deepseek_v3 import DeepseekV3ForCausalLM
from eprt.models.deepseek_v32 import DeepseekV32ForCausalLM
from eprt.models.glm4_moe import Glm4MoeForCausalLM
from eprt.models.kimi_k3 import KimiK3ForConditionalGeneration
from eprt.models.kimi_k25 import KimiK25ForConditionalGeneration
from eprt.models.kimi_linear import KimiLinearForCausalLM
from eprt.models.qwen3_5_moe import Qwen3_5MoeForConditionalGeneration
from eprt.models.qwen3_moe import Qwen3MoeForCausalLM
from eprt.models.qwen3_next import Qwen3NextForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "glm4_moe": Glm4MoeForCausalLM,
    "deepseek_v32": DeepseekV32ForCausalLM,
    "glm_moe_dsa": GlmMoeDsaForCausalLM,
    "kimi_linear": KimiLinearForCausalLM,
    "kimi_k25": KimiK25ForConditionalGeneration,
    "kimi_vl": KimiK25ForConditionalGeneration,  # Kimi-VL's language model is Kimi-K2.5's: DeepSeek-V3
    "kimi_k3": KimiK3ForConditionalGeneration,
    "qwen3_next": Qwen3NextForCausalLM,
    "qwen3_5_moe_text": Qwen3NextForCausalLM,  # Qwen3.5-MoE's language model saved alone runs as Qwen3-Next
    "qwen3_5_moe": Qwen3_5MoeForConditionalGeneration,
}


def model_class(name: str) -> type[nn.Module]:
    if name not in MODEL_CLASSES:
        raise ConfigError(f"no model code for family {name!r}; eprt runs {', '.join(sorted(MODEL_CLASSES))}")
    return MODEL_CLASSES[name]
