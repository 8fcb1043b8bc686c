"""The compressed-tensors schemes as plain dicts, from a table eprt owns: each preset scheme a
format names (`WeightFormat.ct_preset`) with its weights and input_activations arguments, and a KV
cache's arguments, serialized as the library's `QuantizationConfig.model_dump(mode="json")`
serializes them, key order included, so that config.json's quantization_config
(eprt.hf.compressed_tensors_export) is the same bytes as the library would write. The export does
not import the library for it: the import costs more CPU time than the whole unquantized export and
some 230 MiB of memory (it brings transformers). The tests build the same configs with the library's
own classes and compare (tests/test_compressed_tensors_config.py).
"""

from __future__ import annotations

from eprt.quant.formats import WeightFormat

# QuantizationArgs' fields in the order the library declares (and so serializes) them, each with
# its default; `SHOWN_IF_SET` are left out of the dump unless given (the library's serializer drops
# them when None, observer and zp_dtype when not set explicitly).
ARG_DEFAULTS = {
    "num_bits": 8,
    "type": "int",
    "symmetric": True,
    "group_size": None,
    "strategy": None,
    "block_structure": None,
    "dynamic": False,
    "actorder": None,
    "scale_dtype": None,
    "zp_dtype": None,
    "observer": None,
}
SHOWN_IF_SET = {"block_structure", "actorder", "scale_dtype", "zp_dtype", "observer"}


def quantization_args(**given) -> dict:
    """One QuantizationArgs as the library dumps it: every field in its place, the optional ones
    only where given."""
    unknown = set(given) - set(ARG_DEFAULTS)
    if unknown:
        raise ValueError(f"not a compressed-tensors QuantizationArgs field: {sorted(unknown)}")
    return {k: given.get(k, d) for k, d in ARG_DEFAULTS.items() if k not in SHOWN_IF_SET or given.get(k) is not None}


FP8_TENSOR = quantization_args(type="float", strategy="tensor")
FP8_STATIC_INPUT = quantization_args(type="float", strategy="tensor", observer="static_minmax")
FP8_TOKEN_INPUT = quantization_args(type="float", strategy="token", dynamic=True)
NVFP4_WEIGHTS = quantization_args(
    num_bits=4, type="float", group_size=16, strategy="tensor_group", scale_dtype="torch.float8_e4m3fn"
)
INT4_WEIGHTS = quantization_args(num_bits=4, group_size=128, strategy="group")


def mx_args(bits: int, dynamic: bool) -> dict:
    """The MX formats' arguments: blocks of 32 along the input, one E8M0 (uint8) exponent each."""
    return quantization_args(
        num_bits=bits, type="float", group_size=32, strategy="group", dynamic=dynamic, scale_dtype="torch.uint8"
    )


# preset scheme -> (weights, input_activations), as compressed-tensors' `preset_name_to_scheme` gives them
SCHEMES: dict[str, tuple[dict, dict | None]] = {
    "FP8": (FP8_TENSOR, FP8_STATIC_INPUT),
    "FP8_DYNAMIC": (quantization_args(type="float", strategy="channel"), FP8_TOKEN_INPUT),
    "FP8_BLOCK": (
        quantization_args(type="float", strategy="block", block_structure=[128, 128]),
        quantization_args(type="float", group_size=128, strategy="group", dynamic=True),
    ),
    "NVFP4": (
        NVFP4_WEIGHTS,
        {**NVFP4_WEIGHTS, "dynamic": "local", "observer": "static_minmax"},
    ),
    "NVFP4A16": (NVFP4_WEIGHTS, None),
    "W4A16": (INT4_WEIGHTS, None),
    "W4AFP8": (INT4_WEIGHTS, FP8_TOKEN_INPUT),
    "MXFP8": (mx_args(8, False), mx_args(8, True)),
    "MXFP4A16": (mx_args(4, False), None),
}


def scheme(fmt: WeightFormat, targets: list[str]) -> dict:
    """A config group: `fmt`'s preset scheme over `targets`, in its compression format, with the
    format's group size where it is not the preset's (INT4 in groups of 32)."""
    try:
        weights, inputs = SCHEMES[fmt.ct_preset]
    except KeyError:
        raise ValueError(f"{fmt.name}: no compressed-tensors scheme for preset {fmt.ct_preset!r} in SCHEMES") from None
    if fmt.group_size is not None and weights["group_size"] != fmt.group_size:
        weights = {**weights, "group_size": fmt.group_size}
    return {
        "targets": list(targets),
        "weights": dict(weights),
        "input_activations": dict(inputs) if inputs is not None else None,
        "output_activations": None,
        "format": fmt.ct_format,
    }
