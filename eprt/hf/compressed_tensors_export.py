"""The compressed-tensors layout (llm-compressor's, `quant_method: compressed-tensors`) of a
quantized export: the same quantized values as the ModelOpt layout, under its names and scales.

Per quantized Linear (routed experts per expert, under the source's names):
- FP8 (`float-quantized`): weight (float8_e4m3fn), weight_scale and input_scale (float32 [1]),
  the same values ModelOpt writes.
- NVFP4 (`nvfp4-pack-quantized`): weight_packed (uint8, two E2M1 values a byte, the first in the
  low nibble, as ModelOpt packs them), weight_scale (the float8_e4m3fn block scales), and the
  reciprocal per-tensor scales weight_global_scale = 1 / weight_scale_2 and input_global_scale =
  1 / input_scale (float32 [1]): compressed-tensors dequantizes a block as
  value * weight_scale / weight_global_scale.
- KV cache (FP8): the attention module's k_scale and v_scale (float32 [1]).
config.json's quantization_config is built with compressed-tensors' own classes.
"""

from __future__ import annotations

import re

import torch

from eprt.errors import ConfigError
from eprt.quant.nvfp4 import BLOCK_SIZE

NAME = "compressed-tensors"
# eprt format -> compressed-tensors preset scheme and its compression format
PRESET = {"fp8": ("FP8", "float-quantized"), "nvfp4": ("NVFP4", "nvfp4-pack-quantized")}
SCALAR = (1,)


def require() -> None:
    """The compressed-tensors library builds the config: refuse up front, before any output, without it."""
    try:
        import compressed_tensors  # noqa: F401
    except ImportError:
        raise ConfigError("--format compressed-tensors needs the compressed-tensors library: "
                          "pip install 'eprt[compressed]'") from None


def companions(fmt: str, out_dim: int, in_dim: int) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    """The tensors of one quantized Linear: suffix -> (dtype, shape)."""
    if fmt == "fp8":
        return {"weight": (torch.float8_e4m3fn, (out_dim, in_dim)), "weight_scale": (torch.float32, SCALAR),
                "input_scale": (torch.float32, SCALAR)}
    return {"weight_packed": (torch.uint8, (out_dim, in_dim // 2)),
            "weight_scale": (torch.float8_e4m3fn, (out_dim, in_dim // BLOCK_SIZE)),
            "weight_global_scale": (torch.float32, SCALAR), "input_global_scale": (torch.float32, SCALAR)}


def from_modelopt(fmt: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One Linear's tensors under this layout, from its ModelOpt tensors (same quantized values)."""
    if fmt == "fp8":
        return {"weight": t["weight"], "weight_scale": t["weight_scale"].reshape(SCALAR),
                "input_scale": t["input_scale"].reshape(SCALAR)}
    return {"weight_packed": t["weight"], "weight_scale": t["weight_scale"],
            "weight_global_scale": (1 / t["weight_scale_2"]).reshape(SCALAR),
            "input_global_scale": (1 / t["input_scale"]).reshape(SCALAR)}


def kv_scale_name(attn: str, kind: str) -> str:
    return f"{attn}.{kind}_scale"


def ignore_list(unquantized: set[str], unquantized_experts: set[str], passthrough_prefixes: set[str]) -> list[str]:
    """compressed-tensors' `ignore`: unquantized Linears by exact name, an unquantized routed-experts
    module and what travels through unmodeled (MTP layers, a vision tower) by a `re:` prefix."""
    out = set(unquantized)
    out |= {f"re:^{re.escape(m)}\\." for m in unquantized_experts | passthrough_prefixes}
    return sorted(out)


def targets(formats: dict[str, str], others: set[str]) -> dict[str, list[str]]:
    """Each format's config-group targets: ["Linear"] when one format quantizes every targeted
    Linear, else `re:` patterns over the module names with the layer and expert indices
    generalized, or a module's exact name where its pattern would also match a module of another
    format or an unquantized one (`others`)."""
    if len(set(formats.values())) == 1:
        return {next(iter(formats.values())): ["Linear"]}
    out: dict[str, set[str]] = {}
    for module, fmt in formats.items():
        pattern = "re:^" + re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(module)) + "$"
        regex = re.compile(pattern[3:])
        clash = any(regex.match(m) for m in others) or any(
            regex.match(m) for m, f in formats.items() if f != fmt)
        out.setdefault(fmt, set()).add(module if clash else pattern)
    return {fmt: sorted(t) for fmt, t in out.items()}


def quantization_config(formats: set[str], ignore: list[str], kv_cache: str | None, targets: dict[str, list[str]]) -> dict:
    """config.json's quantization_config. `targets`: format -> the modules it quantizes, as
    compressed-tensors targets (["Linear"] when one format covers every quantized Linear)."""
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationStatus,
                                                 preset_name_to_scheme)

    groups = {}
    for i, fmt in enumerate(sorted(formats)):
        preset, compression = PRESET[fmt]
        scheme = preset_name_to_scheme(preset, targets[fmt])
        scheme.format = compression
        groups[f"group_{i}"] = scheme
    kv = QuantizationArgs(num_bits=8, type="float", strategy="tensor", dynamic=False, symmetric=True) \
        if kv_cache == "fp8" else None
    fmt = PRESET[next(iter(formats))][1] if len(formats) == 1 else "mixed-precision"
    qc = QuantizationConfig(config_groups=groups, format=fmt, quantization_status=QuantizationStatus.COMPRESSED,
                            ignore=ignore, kv_cache_scheme=kv)
    return qc.model_dump(mode="json")
