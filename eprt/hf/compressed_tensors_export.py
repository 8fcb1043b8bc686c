"""The compressed-tensors layout (llm-compressor's, `quant_method: compressed-tensors`) of a
quantized export: the same quantized values as the ModelOpt layout, under its names and scales.

Per quantized Linear (routed experts per expert, under the source's names), the tensors its
format gives this layout (`WeightFormat.compressed_tensors_tensors`, eprt.quant.formats: FP8's
`float-quantized` weight, weight_scale and input_scale; NVFP4's `nvfp4-pack-quantized`
weight_packed, block weight_scale and the reciprocal global scales); under a quantized KV cache,
the attention module's k_scale and v_scale (float32 [1]). config.json's quantization_config is
built from eprt's table of compressed-tensors' preset schemes (eprt.hf.compressed_tensors_schemes),
without importing the library.
"""

from __future__ import annotations

import re

from eprt.hf.compressed_tensors_schemes import quantization_args, scheme
from eprt.quant.formats import WeightFormat
from eprt.quant.formats.kv import kv_cache_format
from eprt.storage.encodings import CT, MIXED_FORMAT

NAME = CT


def kv_scale_name(attn: str, kind: str) -> str:
    return f"{attn}.{kind}_scale"


def ignore_list(unquantized: set[str], unquantized_experts: set[str], passthrough_prefixes: set[str]) -> list[str]:
    """compressed-tensors' `ignore`: unquantized Linears by exact name, an unquantized routed-experts
    module and what travels through unmodeled (MTP layers, a vision tower) by a `re:` prefix."""
    out = set(unquantized)
    out |= {f"re:^{re.escape(m)}\\." for m in unquantized_experts | passthrough_prefixes}
    return sorted(out)


def targets(formats: dict[str, WeightFormat], others: set[str]) -> dict[WeightFormat, list[str]]:
    """Each format's config-group targets: ["Linear"] when one format quantizes every targeted
    Linear, else `re:` patterns over the module names with the layer and expert indices
    generalized, or a module's exact name where its pattern would also match a module of another
    format or an unquantized one (`others`)."""
    if len(set(formats.values())) == 1:
        return {next(iter(formats.values())): ["Linear"]}
    out: dict[WeightFormat, set[str]] = {}
    for module, fmt in formats.items():
        pattern = "re:^" + re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(module)) + "$"
        regex = re.compile(pattern[3:])
        clash = any(regex.match(m) for m in others) or any(regex.match(m) for m, f in formats.items() if f != fmt)
        out.setdefault(fmt, set()).add(module if clash else pattern)
    return {fmt: sorted(t) for fmt, t in out.items()}


def quantization_config(
    formats: set[WeightFormat], ignore: list[str], kv_cache: str | None, targets: dict[WeightFormat, list[str]]
) -> dict:
    """config.json's quantization_config, as compressed-tensors' `QuantizationConfig.model_dump`
    gives it. `targets`: format -> the modules it quantizes, as compressed-tensors targets
    (["Linear"] when one format covers every quantized Linear)."""
    groups = {f"group_{i}": scheme(fmt, targets[fmt]) for i, fmt in enumerate(sorted(formats, key=lambda f: f.name))}
    kv_format = kv_cache_format(kv_cache)
    return {
        "config_groups": groups,
        "quant_method": NAME,
        "kv_cache_scheme": quantization_args(**kv_format.ct_args) if kv_format is not None else None,
        "format": next(iter(formats)).ct_format if len(formats) == 1 else MIXED_FORMAT,
        "quantization_status": "compressed",
        "global_compression_ratio": None,
        "ignore": list(ignore),
        "moe_sparsity_config": None,
    }
