"""Source weights that stay encoded on disk and are decoded when read (docs/sources.md, 'Encoded sources').

- compressed-tensors formats (Kimi's INT4 `pack-quantized`, MXFP4, NVFP4, ...) are decoded by
  the compressed-tensors library itself, one 2-D weight at a time (its MXFP4/NVFP4 decompressors
  take 2-D tensors only). The library is optional (`eprt[compressed]`): it is imported only when
  a compressed checkpoint is converted or decoded, and it pulls in transformers.
- block FP8 (DeepSeek-V3, Kimi-K2-Instruct) is decoded here: w = fp8 * weight_scale_inv per
  128x128 block, the last blocks partial where a dimension is not a multiple of 128. MXFP8
  (MiniMax-M3: blocks of 1x32) is block FP8 whose weight_scale_inv holds E8M0 exponents (uint8
  e: the scale 2^(e - 127)) in place of fp32 scales.
- OpenAI's MXFP4 (GPT-OSS: `P_blocks` and `P_scales` of each fused expert weight P) is decoded
  here too (eprt.storage.mxfp4_blocks).
- per-tensor FP8 (Mistral-Small-4: quant_method fp8 without weight_block_size) is decoded here
  too: w = fp8 * weight_scale_inv, one scale per weight (or per equal span of its rows: fused
  experts hold one per expert, or one for each expert's gate rows and one for its up rows).
  With static activations each weight also has the `activation_scale` its inputs were measured
  at, kept beside it.

An encoded weight of module M is kept as the source's own tensors `M.<component>`
(`weight_packed`, `weight_scale`, ... or `weight`, `weight_scale_inv`), so export can write them
back byte for byte. Fused experts, a parameter P (`experts.gate_up_proj`) rather than a module's
weight, spell theirs as transformers does: `P`, `P_scale_inv`, `P_activation_scale`
(`component_names`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from eprt.errors import CheckpointError, ConfigError
from eprt.storage import source_decoders
from eprt.storage.deepseek_encodings import DeepSeekFP4, e8m0_exponents
from eprt.storage.mxfp4_blocks import MXFP4_BLOCKS, MxFp4Blocks
from eprt.storage.source_decoders import SourceDecoder, register, suffix_finder
from eprt.storage.source_finders import (  # component_names and matches: the config's rules, read here by name
    component_names,  # noqa: F401
    ct_finder,
    ct_group,
    deepseek_finder,
    fp8_finder,
    matches,  # noqa: F401
)

RAW = "raw"
FP8_BLOCK = "fp8-block"
FP8_TENSOR = "fp8-tensor"
# DeepSeek-V4's release: FP8 and FP4 weights with an E8M0 `scale` (eprt.storage.deepseek_encodings)
DEEPSEEK_FP8 = "deepseek-fp8"
DEEPSEEK_FP4 = "deepseek-fp4"
CT = "compressed-tensors"
CT_PREFIX = CT + "/"
MIN_VERSION = (0, 20)  # the classmethod compressor API: get_value_from_registry, decompress(state_dict, scheme)
INSTALL = "pip install 'compressed-tensors>=0.20' (or pip install 'eprt[compressed]')"
# What block FP8 decodes to: DeepSeek's own dequantization computes in fp32 and rounds to bf16.
FP8_DECODED = torch.bfloat16


def release(version: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", version)[:2])


def library(where: str):
    """The compressed-tensors package, once it is known to be installed and new enough."""
    try:
        import compressed_tensors
    except ImportError:
        raise ConfigError(
            f"{where}: holds compressed-tensors weights, and the compressed-tensors library that "
            f"decodes them is not installed: {INSTALL}"
        ) from None
    version = getattr(compressed_tensors, "__version__", "0")
    if release(version) < MIN_VERSION:
        raise ConfigError(
            f"{where}: compressed-tensors {version} is older than 0.20, the first release with the "
            f"compressor API eprt decodes with: pip install -U 'compressed-tensors>=0.20'"
        )
    return compressed_tensors


# The compressed-tensors formats eprt decodes. A format string reaches the library's registry only
# once it is one of these: the registry reads any other `path/file.py:name` as a plugin to import
# and run, so a checkpoint could name a Python file of its own.
CT_FORMATS = (
    "pack-quantized",
    "mxfp4-pack-quantized",
    "nvfp4-pack-quantized",
    "int-quantized",
    "float-quantized",
    "naive-quantized",
)
# compressed-tensors' top-level format of a config whose groups each name their own
MIXED_FORMAT = "mixed-precision"


def is_known(encoding) -> bool:
    return isinstance(encoding, str) and (encoding == RAW or source_decoders.registered(encoding) is not None)


def known() -> list[str]:
    """Every encoding a checkpoint's tensor may have: stored as it is (raw), or a registered one."""
    return [RAW, *(d.encoding for d in source_decoders.entries())]


def check_ct_format(fmt, where: str) -> str:
    """`fmt`, once it is a compressed-tensors format eprt decodes; refused by name otherwise."""
    if fmt not in CT_FORMATS:
        raise ConfigError(
            f"{where}: compressed-tensors format {fmt!r} is not one eprt decodes "
            f"({', '.join(CT_FORMATS)}); dequantize the checkpoint to bf16 first"
        )
    return fmt


# --- the source's quantization_config ---------------------------------------------------------


@dataclass(frozen=True)
class SourceQuantization:
    method: str  # "compressed-tensors", "fp8" or "mxfp4"
    config: dict  # quantization_config as config.json has it
    where: str  # config.json and the key that holds it, for messages

    @property
    def ignore(self) -> list[str]:
        return list(self.config.get("ignore") or [])

    def groups(self) -> dict[str, dict]:
        """compressed-tensors: each config group with its format resolved (the group's, else the top level's)."""
        top = self.config.get("format")
        return {g: {**d, "format": d.get("format") or top} for g, d in (self.config.get("config_groups") or {}).items()}


def source_quantization(hf: dict, where: str) -> SourceQuantization | None:
    """The quantization_config of a config.json (top level, or a VLM's text_config), checked;
    refuses what eprt cannot read as it is stored."""
    found = [
        (k, h["quantization_config"])
        for k, h in (("quantization_config", hf), ("text_config.quantization_config", hf.get("text_config") or {}))
        if h.get("quantization_config")
    ]
    if not found:
        return None
    if len(found) > 1 and found[0][1] != found[1][1]:
        raise ConfigError(
            f"{where}: quantization_config and text_config.quantization_config differ, so which one "
            "describes the weights is ambiguous; keep the one that does"
        )
    key, qc = found[0]
    where = f"{where} ({key})"
    method = qc.get("quant_method")
    if method == "fp8":
        block = qc.get("weight_block_size")
        if block is not None and (
            not isinstance(block, list) or len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block)
        ):
            raise ConfigError(
                f"{where}: weight_block_size {block!r} is not two positive integers (block FP8) "
                "nor null (per-tensor FP8)"
            )
        if qc.get("fmt", "e4m3") != "e4m3":
            raise ConfigError(f"{where}: fmt {qc.get('fmt')!r}: eprt reads FP8 in e4m3 only")
        if qc.get("activation_scheme", "dynamic") not in ("dynamic", "static"):
            raise ConfigError(
                f"{where}: activation_scheme {qc.get('activation_scheme')!r} is neither 'dynamic' nor 'static'"
            )
    elif method == CT:
        library(where)
        from compressed_tensors.quantization import QuantizationConfig

        groups = qc.get("config_groups")
        if not groups or not isinstance(groups, dict) or not all(isinstance(d, dict) for d in groups.values()):
            raise ConfigError(f"{where}: no config_groups, so no scheme to decode the compressed weights with")
        # the top-level format too: a consumer of the config (an export written back as stored) reads it
        if qc.get("format") not in (None, MIXED_FORMAT):
            check_ct_format(qc["format"], f"{where} format")
        for group, d in SourceQuantization(method, qc, where).groups().items():
            check_ct_format(d["format"], f"{where} config group {group!r}")
        try:
            QuantizationConfig.model_validate(qc)
        except ValueError as e:
            raise ConfigError(f"{where}: compressed-tensors cannot parse it: {first_problem(e)}") from None
    elif method == MXFP4_BLOCKS:
        kept = qc.get("modules_to_not_convert")
        if kept is not None and (not isinstance(kept, list) or not all(isinstance(m, str) for m in kept)):
            raise ConfigError(f"{where}: modules_to_not_convert {kept!r:.80} is not a list of module names")
    elif not source_decoders.announced_by(method):
        raise ConfigError(
            f"{where}: quant_method {method!r} is not read by eprt, which reads quant_method "
            f"{', '.join(source_decoders.methods())} (FP8 block or per-tensor, MXFP4 as GPT-OSS stores it, "
            "and the encodings registered in eprt.storage.source_decoders); dequantize the checkpoint to bf16 first"
        )
    return SourceQuantization(method, qc, where)


def first_problem(e: ValueError) -> str:
    """The first thing a validation error found, on one line."""
    errors = getattr(e, "errors", None)
    if callable(errors) and errors():
        err = errors()[0]
        return f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}"
    return " ".join(str(e).split())


def without_quantization(config: dict) -> dict:
    """config.json for the same model with its weights decoded: no quantization_config anywhere."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    if isinstance(out.get("text_config"), dict):
        out["text_config"] = without_quantization(out["text_config"])
    return out


def fp8_encoding(quant: SourceQuantization) -> str:
    """The FP8 encoding a quant_method fp8 config describes: block with weight_block_size, else per-tensor."""
    return FP8_BLOCK if quant.config.get("weight_block_size") else FP8_TENSOR


# --- decoders ---------------------------------------------------------------------------------


class BlockFP8:
    """DeepSeek-V3's block FP8: `weight` float8_e4m3fn, `weight_scale_inv` fp32 per block (or, MXFP8,
    an E8M0 exponent per block)."""

    components = ("weight", "weight_scale_inv")
    batched = True  # decodes weights stacked along leading dims, each with its own blocks
    on_device = True  # plain tensor arithmetic: decodes on the device its components are on

    def __init__(self, scheme: dict):
        self.block = tuple(scheme["weight_block_size"])

    def decode(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_block_fp8(c["weight"], c["weight_scale_inv"], self.block)


class DeepSeekFP8(BlockFP8):
    """DeepSeek-V4's block FP8: `weight` float8_e4m3fn, `scale` an E8M0 (float8_e8m0fnu) per 128x128 block."""

    components = ("weight", "scale")

    def __init__(self):
        self.block = (128, 128)

    def decode(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_block_fp8(c["weight"], e8m0_exponents(c["scale"]), self.block)


class TensorFP8:
    """Per-tensor FP8: `weight` float8_e4m3fn, `weight_scale_inv` fp32 of one value per weight (or
    per equal span of its rows), and under static activations its `activation_scale`, carried."""

    batched = True
    on_device = True

    def __init__(self, scheme: dict):
        static = scheme.get("activation_scheme") == "static"
        self.components = (
            ("weight", "weight_scale_inv", "activation_scale") if static else ("weight", "weight_scale_inv")
        )

    def decode(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return dequantize_tensor_fp8(c["weight"], c["weight_scale_inv"])


def dequantize_tensor_fp8(w: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype = FP8_DECODED) -> torch.Tensor:
    """w [..., rows, cols] in fp8 times its scale in fp32, rounded to `dtype`. Leading dims stack
    weights (fused experts); each has `n` scales (scale_inv [...], [..., n] or [..., n, 1]), scale j
    over the j-th of n equal spans of its rows; or one scalar scales them all."""
    if scale_inv.dim() == 0:
        return (w.float() * scale_inv.float()).to(dtype)
    lead, (rows, cols) = w.shape[:-2], w.shape[-2:]
    per_weight = scale_inv.numel() // max(math.prod(lead), 1)
    shape_ok = tuple(scale_inv.shape[: len(lead)]) == tuple(lead) and all(
        n == 1 for n in scale_inv.shape[len(lead) + 1 :]
    )
    if not shape_ok or per_weight * math.prod(lead) != scale_inv.numel() or not per_weight or rows % per_weight:
        raise CheckpointError(
            f"weight_scale_inv has shape {list(scale_inv.shape)}, which is not one scale per weight of "
            f"{list(w.shape)} (nor one per equal span of its {rows} rows)"
        )
    x = w.float()
    x.view(*lead, per_weight, rows // per_weight, cols).mul_(scale_inv.float().reshape(*lead, per_weight, 1, 1))
    return x.to(dtype)


def dequantize_block_fp8(
    w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128), dtype: torch.dtype = FP8_DECODED
) -> torch.Tensor:
    """w [..., rows, cols] in fp8 times its block's scale, in fp32, rounded to `dtype`; leading dims
    stack weights, each with its own blocks. Where the blocks tile the weight, the scales multiply
    a blocked view in place (no per-element copy of them: a third less memory traffic); the same
    products, so the same bits."""
    (rows, cols), (bo, bi) = w.shape[-2:], block
    want = (*w.shape[:-2], math.ceil(rows / bo), math.ceil(cols / bi))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(
            f"weight_scale_inv has shape {list(scale_inv.shape)}, but a {rows}x{cols} weight in "
            f"{bo}x{bi} blocks needs {list(want[-2:])}"
        )
    x, scale = w.float(), e8m0_scales(scale_inv) if scale_inv.dtype == torch.uint8 else scale_inv.float()
    if rows % bo or cols % bi:
        return (x * expand_blocks(scale, w.shape, block)).to(dtype)
    lead = w.shape[:-2]
    blocked = x.view(*lead, rows // bo, bo, cols // bi, bi)
    blocked.mul_(scale.view(*lead, rows // bo, 1, cols // bi, 1))
    return x.to(dtype)


def e8m0_scales(e: torch.Tensor) -> torch.Tensor:
    """OCP MX's E8M0 scales (uint8 exponents, bias 127; 255 is NaN) as fp32: exact, 2^-127 a subnormal."""
    return torch.exp2(e.float() - 127.0).masked_fill(e == 255, float("nan"))


def expand_blocks(per_block: torch.Tensor, shape: tuple[int, ...], block: tuple[int, int]) -> torch.Tensor:
    """One value per block -> one per element of a `shape` tensor (its last two dims blocked, leading
    dims stacked); the last blocks may be partial."""
    (rows, cols), (bo, bi) = shape[-2:], block
    return per_block.repeat_interleave(bo, -2)[..., :rows, :].repeat_interleave(bi, -1)[..., :cols]


class CompressedTensors:
    """One compressed-tensors format and scheme, decoded by the library's compressor."""

    def __init__(self, fmt: str, scheme: dict, where: str):
        version = library(where).__version__
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationScheme

        check_ct_format(fmt, where)
        try:
            self.compressor = BaseCompressor.get_value_from_registry(fmt)
        except (KeyError, ValueError):
            have = ", ".join(sorted(BaseCompressor.registered_names()))
            raise ConfigError(
                f"{where}: format {fmt!r} has no compressor in the installed compressed-tensors "
                f"{version} (it has {have}): pip install -U compressed-tensors, to a release that "
                "reads it"
            ) from None
        self.scheme = QuantizationScheme.model_validate({**scheme, "format": fmt})
        try:
            self.components = tuple(self.compressor.compression_param_names(self.scheme))
        except NotImplementedError:
            raise ConfigError(
                f"{where}: compressed-tensors' {fmt!r} compressor does not decompress one weight "
                "at a time, which eprt needs to decode each rank's experts alone"
            ) from None

    def decode(self, c: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.compressor.decompress(c, self.scheme)["weight"]


def decoder(encoding: str, scheme: dict, where: str):
    """The decoder of one encoding and scheme, from its registry entry (eprt.storage.source_decoders;
    the built-in encodings' are registered below): `.components` (the source tensors of one weight,
    by local name) and `.decode(components) -> weight`."""
    entry = source_decoders.registered(encoding)
    if entry is None:
        raise CheckpointError(f"{where}: encoding {encoding!r} is unknown to this eprt; upgrade eprt")
    return entry.decoder(scheme, where)


def decoded_dtype_ok(decoded: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether weights decoded to `decoded` keep every bit when held in `dtype`."""
    return dtype in (decoded, torch.float32, torch.float64)


# --- the built-in encodings, as entries of the registry (eprt.storage.source_decoders) ------------
# Found by eprt.storage.source_finders, decoded by the decoders above and those of
# eprt.storage.deepseek_encodings and eprt.storage.mxfp4_blocks; registered when this module is
# imported, as every reader of a source or a checkpoint does.

FP8_METHOD = "fp8"


def fp8_components(encoding: str):
    """The components of a weight stored in FP8 encoding `encoding`, where the source's FP8 is it."""
    return lambda quant: (
        decoder(encoding, quant.config, quant.where).components if fp8_encoding(quant) == encoding else None
    )


def ct_components(scheme: dict, where: str) -> tuple[str, ...]:
    return decoder(CT_PREFIX + scheme["format"], scheme, where).components


register(SourceDecoder(FP8_BLOCK, (FP8_METHOD,), fp8_finder(fp8_components(FP8_BLOCK)), lambda s, _: BlockFP8(s)))
register(SourceDecoder(FP8_TENSOR, (FP8_METHOD,), fp8_finder(fp8_components(FP8_TENSOR)), lambda s, _: TensorFP8(s)))
register(SourceDecoder(DEEPSEEK_FP8, (FP8_METHOD,), deepseek_finder(torch.float8_e4m3fn), lambda s, _: DeepSeekFP8()))
register(SourceDecoder(DEEPSEEK_FP4, (FP8_METHOD,), deepseek_finder(torch.int8), lambda s, _: DeepSeekFP4()))
register(
    SourceDecoder(
        MXFP4_BLOCKS, (MXFP4_BLOCKS,), suffix_finder(blocks="_blocks", scales="_scales"), lambda s, _: MxFp4Blocks(s)
    )
)
for _fmt in CT_FORMATS:
    register(
        SourceDecoder(
            CT_PREFIX + _fmt,
            (CT,),
            ct_finder(_fmt, ct_components),
            lambda s, where, fmt=_fmt: CompressedTensors(fmt, s, where),
            ct_group,
        )
    )
