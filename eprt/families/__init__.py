"""Family readers: each module registers the model_types it reads (config fields and tensor layout)."""

from eprt.families import deepseek_v3, kimi_k3, kimi_k25, kimi_linear, qwen3_5_moe, qwen3_moe, qwen3_next  # noqa: F401
