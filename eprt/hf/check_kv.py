"""The KV-cache scales of a ModelOpt-layout export: k_scale and v_scale on every attention with a
KV cache, exactly when hf_quant_config.json names a kv_cache_quant_algo, each a scale the engines'
fp32 arithmetic survives (eprt.hf.check_scale_range)."""

from __future__ import annotations

from eprt.hf.check_exclusions import Exclusions
from eprt.hf.check_names import attention_modules
from eprt.hf.check_scale_range import check_kv, scalar_scale
from eprt.quant.formats.kv import kv_by_quant_algo

KV_SCALES = {"k_scale": "k_proj", "v_scale": "v_proj"}  # leaf -> the projection it is stored under
# Vision towers attend without a KV cache; vLLM's modelopt loader names them so.
VISION_PREFIXES = ("vision_tower.", "vision_model.", "visual.")


def check_kv_scales(tensors: dict, kv_algo: str | None, exclude: Exclusions, problems: list[str]) -> None:
    """k_scale/v_scale on every attention layer with a KV cache when kv_cache_quant_algo names a KV
    format (eprt.quant.formats.kv); `tensors`: name -> header (eprt.hf.check_files.StoredTensor).

    A layer excluded whole by a pattern (DeepSeek-V3's multi-token-prediction layer,
    `model.layers.61.*`) is outside the quantized model and needs none."""
    # KDA keeps a recurrent state (its A_log), not a KV cache
    attention = {
        a for a in attention_modules(tensors) if not a.startswith(VISION_PREFIXES) and f"{a}.A_log" not in tensors
    }
    for name in sorted(tensors):
        module, _, leaf = name.rpartition(".")
        if leaf not in KV_SCALES:
            continue
        if kv_algo is None:
            problems.append(f"{name}: KV-cache scale in an export without kv_cache_quant_algo")
        elif module.rpartition(".")[0] not in attention or not module.endswith(f".{KV_SCALES[leaf]}"):
            problems.append(f"{name}: not on an attention layer's {KV_SCALES[leaf]}")
    kv = kv_by_quant_algo(kv_algo)
    if kv is None:
        return
    for attn in sorted(attention):
        if any("*" in e for e in exclude.matching(attn)):
            continue
        for leaf, proj in KV_SCALES.items():
            name = f"{attn}.{proj}.{leaf}"
            t = tensors.get(name)
            if t is None:
                problems.append(f"{name}: missing; kv_cache_quant_algo is {kv_algo}")
            elif (scale := scalar_scale(name, t, problems)) is not None:
                check_kv(scale, kv, problems)
