"""The KV-cache formats, by the name a recipe's `kv_cache:` (or `--kv-cache`) gives them: how cached
keys and values are scaled (one fp32 k_scale and v_scale per attention) and how each export layout
declares it. A registry apart from the weight formats: a KV format quantizes no weight, and an
export may combine any weight format with any KV format.

Both formats write k_scale = k_amax / 448 and v_scale = v_amax / 448, as ModelOpt 0.47 defines the KV
scale "for both FP8 and NVFP4 KV cache quantization" (`unified_export_hf`); under NVFP4 the engine
quantizes keys and values in blocks of 16 along the head dim under that amax's NVFP4 per-tensor
scale, amax / (6 x 448).
"""

from __future__ import annotations

import torch

from eprt.quant.formats.e2m1 import E2M1_MAX
from eprt.quant.formats.fp8 import fake_quant_fp8, fp8_scale
from eprt.quant.formats.nvfp4 import BLOCK_SIZE, NVFP4
from eprt.quant.numerics import FP8_E4M3_MAX


class KvCacheFormat:
    """One KV-cache format; subclasses set the attributes and implement the methods."""

    name: str  # the recipe's `kv_cache:`
    quant_algo: str  # hf_quant_config.json's kv_cache_quant_algo
    largest: float  # the largest cached value a scale of 1 stands for (eprt.hf.check_scale_range)
    modelopt_scheme: dict | str  # config.json's kv_cache_scheme (ModelOpt)
    ct_args: dict | None  # compressed-tensors' QuantizationArgs of its kv_cache_scheme; None: no such layout
    block: int | None = None  # cached elements along the head dim that share a scale; None: the scale is per tensor

    def unfit_head_dim(self, width: int) -> bool:
        """Whether heads of `width` cannot be cached in this format (its blocks must fill them)."""
        return self.block is not None and width % self.block != 0

    def scale(self, amax) -> torch.Tensor:
        """k_scale or v_scale (fp32 0-dim) of the keys' or values' amax."""
        raise NotImplementedError

    def fake_quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        """Keys or values as the engine caches them, in x's dtype."""
        raise NotImplementedError


class Fp8KvCache(KvCacheFormat):
    """Keys and values in FP8 E4M3 under a static per-tensor scale each (amax / 448)."""

    name = "fp8"
    quant_algo = "FP8"  # hf_quant_config.json's kv_cache_quant_algo
    largest = FP8_E4M3_MAX
    modelopt_scheme = {"dynamic": False, "num_bits": 8, "type": "float"}
    ct_args = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True}

    def scale(self, amax) -> torch.Tensor:
        return fp8_scale(amax)

    def fake_quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return fake_quant_fp8(x, scale)


class Nvfp4KvCache(KvCacheFormat):
    """Keys and values in NVFP4 (E2M1 in blocks of 16 along the head dim, E4M3 block scales the engine
    computes at run time) under a static per-tensor scale each, stored as amax / 448."""

    name = "nvfp4"
    quant_algo = "NVFP4"
    largest = FP8_E4M3_MAX  # the stored scale times 448 is the amax it stands for
    modelopt_scheme = "NVFP4"  # ModelOpt's config converter writes the algorithm's name for a KV cache not FP8
    ct_args = None  # compressed-tensors has no NVFP4 KV-cache layout: refused in that layout
    block = BLOCK_SIZE

    def scale(self, amax) -> torch.Tensor:
        return fp8_scale(amax)

    def fake_quantize(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        if self.unfit_head_dim(x.shape[-1]):  # refused before the run (eprt.quant.run.setup.check_kv_cache)
            raise ValueError(
                f"--kv-cache nvfp4 quantizes cached keys and values in blocks of {BLOCK_SIZE} along the head dim, "
                f"and this model caches heads of {x.shape[-1]}: calibrate with --kv-cache fp8"
            )
        # NVFP4's per-tensor scale amax / (6 x 448) from the stored amax / 448 (within an fp32 rounding)
        return NVFP4.fake_quantize_input(x, scale / E2M1_MAX)


KV_CACHE_FORMATS: dict[str, KvCacheFormat] = {f.name: f for f in (Fp8KvCache(), Nvfp4KvCache())}


def kv_cache_format(name: str | None) -> KvCacheFormat | None:
    """The KV format a recipe names, None for an unquantized KV cache."""
    return None if name is None else KV_CACHE_FORMATS[name]


def kv_by_quant_algo(quant_algo) -> KvCacheFormat | None:
    """The KV format ModelOpt's kv_cache_quant_algo names, or None (null, or one eprt does not write)."""
    return next((f for f in KV_CACHE_FORMATS.values() if f.quant_algo == quant_algo), None)


def kv_by_ct_scheme(scheme) -> KvCacheFormat | None:
    """The KV format of compressed-tensors' kv_cache_scheme (a dict of QuantizationArgs), or None."""
    return next(
        (
            f
            for f in KV_CACHE_FORMATS.values()
            if isinstance(scheme, dict)
            and f.ct_args is not None
            and all(scheme.get(k) == f.ct_args[k] for k in ("num_bits", "type"))
        ),
        None,
    )
