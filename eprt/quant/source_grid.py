"""The INT4 grid of a rule that names none (a rule's `grid:`, eprt.quant.formats.int4.GRIDS): the
source's.

A Kimi release that stores weights in INT4 (Kimi-K2-Thinking, K2.5: compressed-tensors
`pack-quantized`, 4-bit int) stores them on the Kimi grid, codes -7..7 at about amax / 7: only on
that grid does a decoded release re-quantize to its own codes and scales, so such a source keeps
`kimi`. Every other source takes `full`, compressed-tensors' own grid (codes -8..7 at about
amax / 7.5), which leaves 4-7% less KL on a trained model (docs/quality.md, "INT4's grid"); an
INT4 source that is no Kimi release was written by that library's quantizer, on that grid.

The choice is made where a recipe meets its source (the calibration, the data-free and the
model-free export) and recorded by the format names the resolved rules hold (`int4_g32_full`),
which the calibrated checkpoint's recipe, its report and a resumed run's fingerprint keep.
"""

from __future__ import annotations

from typing import Iterable

from eprt.quant.formats.int4 import FULL, KIMI
from eprt.storage import encodings
from eprt.storage.checkpoint import Checkpoint

# the model_types of the Kimi releases (their config.json's); K2-Thinking's is read as DeepSeek-V3
KIMI_RELEASES = frozenset({"kimi_k2", "kimi_k25", "kimi_vl", "kimi_linear", "kimi_k3"})
INT4_FORMAT = "pack-quantized"


def is_int4_scheme(scheme: dict) -> bool:
    """Whether a compressed-tensors config group (its format resolved) stores 4-bit integer weights."""
    weights = scheme.get("weights") or {}
    return scheme.get("format") == INT4_FORMAT and weights.get("type") == "int" and weights.get("num_bits") == 4


def int4_grid(model_type: str | None, schemes: Iterable[dict]) -> str:
    """`kimi` for a Kimi release with weights stored in INT4 (`schemes`: the compressed-tensors
    config groups its encoded weights name), `full` for any other source."""
    kimi_int4 = model_type in KIMI_RELEASES and any(is_int4_scheme(s) for s in schemes)
    return KIMI.name if kimi_int4 else FULL.name


def checkpoint_int4_grid(ck: Checkpoint) -> str:
    """The grid of an eprt checkpoint's source: the schemes its encoded tensors name (convert
    records each one's, eprt.hf.convert)."""
    used = {t.scheme for t in ck.tensors.values() if t.encoded and t.encoding.startswith(encodings.CT_PREFIX)}
    return int4_grid(ck.config.model_type, (ck.schemes[s] for s in sorted(used)))


def hf_int4_grid(hf_config: dict, quant: encodings.SourceQuantization | None) -> str:
    """The grid of a Hugging Face source, from its config.json and quantization_config."""
    schemes = quant.groups().values() if quant is not None and quant.method == encodings.CT else ()
    return int4_grid(hf_config.get("model_type"), schemes)
