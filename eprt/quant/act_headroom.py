"""Activation headroom for NVFP4 input scales (a recipe's `act_headroom`): ModelOpt's
`nvfp4_act_headroom` calibration, the same numbers bit for bit.

NVFP4 W4A4 quantizes each input at run time in blocks of 16, each with an E4M3 scale of the
block's amax over the per-tensor input scale. Max calibration puts the per-tensor amax at the
largest input seen, so a larger input at serving time saturates its block scale. Headroom instead
reads the distribution of the calibration inputs' block amax (a histogram of their log2, 512 bins
over 2^-40 .. 2^40) and sets

    amax = max(rho x anchor, upper)

`anchor` the block amax at `anchor_percentile` (blocks below upper / 10^6 left out), `upper` the
one at `upper_percentile` (the literal max at 100), each read at its bin's centre: the calibrated
blocks sit in the lower part of E4M3's range, the rest of it above them. A block above `upper`
saturates (so a rare block far above the rest does not push every other block's scale under
E4M3's smallest).

The histograms are counts, summed over the ranks (exact), so every layout computes the amax of
one process over the same tokens (ModelOpt's data-parallel runs take the largest rank's amax
instead). A routed expert has its own histograms (its input's and its activation's, as ModelOpt's
per-expert quantizers do), and the layer's input scale is then the largest expert's, as with max.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from eprt.errors import ConfigError
from eprt.quant.formats import weight_format

FP8_NORMAL_RANGE = 28672.0  # E4M3's largest normal over its smallest: 448 / 2^-6
ANCHOR_FLOOR_RATIO = 1e6  # blocks below upper / this are left out of the anchor


@dataclass(frozen=True)
class ActHeadroom:
    """The settings (ModelOpt's names and defaults)."""

    anchor_percentile: float = 1.0
    upper_percentile: float = 99.99
    rho: float = 16384.0
    bins: int = 512
    log2_min: float = -40.0
    log2_max: float = 40.0

    def to_json(self) -> dict:
        """The settings a recipe names (what `parse_act_headroom` reads back)."""
        return {"anchor_percentile": self.anchor_percentile, "upper_percentile": self.upper_percentile, "rho": self.rho}

    def bin_of(self, log2_values: torch.Tensor) -> torch.Tensor:
        frac = (log2_values - self.log2_min) / (self.log2_max - self.log2_min)
        return (frac * self.bins).floor().long().clamp_(0, self.bins - 1)

    def histogram(self, x: torch.Tensor, block: int) -> torch.Tensor:
        """int64 [bins]: the nonzero block amax of x (blocks of `block` along its last dim) by log2 bin."""
        return self.histograms(x, torch.zeros(x.shape[:-1].numel(), dtype=torch.long, device=x.device), 1, block)[0]

    def histograms(self, x: torch.Tensor, owner: torch.Tensor, count: int, block: int) -> torch.Tensor:
        """int64 [count, bins]: each owner's histogram; `owner` [rows]: which of `count` each row of x is."""
        # |x|'s block max from each block's extremes: the same values, without a copy of |x|
        lo, hi = torch.aminmax(x.detach().reshape(-1, x.shape[-1] // block, block), dim=-1)
        block_amax = torch.maximum(hi, -lo).float()
        keys = owner.reshape(-1, 1).expand_as(block_amax)[block_amax > 0]
        nonzero = block_amax[block_amax > 0]
        flat = keys * self.bins + self.bin_of(torch.log2(nonzero))
        return torch.bincount(flat, minlength=count * self.bins).reshape(count, self.bins)

    def _percentile(self, counts: torch.Tensor, percentile: float, floor: float | None = None) -> float | None:
        """The bin centre at `percentile` of `counts` (bins below `floor`'s left out), as ModelOpt reads it."""
        counts = counts.float()
        if floor is not None and floor > 0:
            counts[: int(self.bin_of(torch.log2(torch.tensor(floor))).item())] = 0
        total = counts.sum()
        if total <= 0:
            return None
        index = int(torch.searchsorted(torch.cumsum(counts, 0), percentile / 100.0 * total).clamp(0, self.bins - 1))
        return float(2.0 ** (self.log2_min + (index + 0.5) / self.bins * (self.log2_max - self.log2_min)))

    def amax(self, counts: torch.Tensor, running_max: torch.Tensor) -> torch.Tensor:
        """fp32 0-dim: the headroom amax of one input from its histogram and its largest |x|
        (0 where nothing was seen: no histogram, as max calibration records)."""
        if not counts.any():
            return running_max.float().reshape(()).clone()
        upper = (
            float(running_max) if self.upper_percentile >= 100.0 else self._percentile(counts, self.upper_percentile)
        )
        anchor = self._percentile(counts, self.anchor_percentile, upper / ANCHOR_FLOOR_RATIO) if upper else None
        if not upper or upper <= 0 or not anchor or anchor <= 0:
            return running_max.float().reshape(()).clone()
        amax = max(self.rho * anchor, upper)
        return torch.tensor(float(amax), dtype=torch.float32, device=running_max.device)


def parse_act_headroom(value, source: str) -> ActHeadroom | None:
    """A recipe's `act_headroom`: false (or absent), true (ModelOpt's defaults), or a mapping of
    anchor_percentile, upper_percentile and rho."""
    if value is False or value is None:
        return None
    if value is True:
        return ActHeadroom()
    fields = ("anchor_percentile", "upper_percentile", "rho")
    if not isinstance(value, dict) or set(value) - set(fields):
        raise ConfigError(
            f"{source}: act_headroom {value!r:.80}; write true (ModelOpt's nvfp4_act_headroom defaults), "
            f"false, or a mapping of {', '.join(fields)}"
        )
    for name, given in value.items():
        if isinstance(given, bool) or not isinstance(given, (int, float)):
            raise ConfigError(f"{source}: act_headroom {name} {given!r}: write a number")
    got = ActHeadroom(**{k: float(v) for k, v in value.items()})
    for name in ("anchor_percentile", "upper_percentile"):
        if not 0.0 < getattr(got, name) <= 100.0:
            raise ConfigError(f"{source}: act_headroom {name} {getattr(got, name)}: a percentile in (0, 100]")
    if not 0.0 < got.rho < FP8_NORMAL_RANGE:
        raise ConfigError(
            f"{source}: act_headroom rho {got.rho}: choose it in (0, {FP8_NORMAL_RANGE:.0f}), E4M3's normal range "
            "(larger leaves more headroom above the calibrated inputs and less room below them)"
        )
    return got


def headroom_targets(recipe, targets: list[str]) -> dict[str, tuple[ActHeadroom, int]]:
    """The targets (modules calibration observes) whose input amax `recipe`'s act_headroom sets:
    those whose format quantizes inputs in blocks under a calibrated per-tensor scale, each with
    the settings and the block size."""
    if recipe.act_headroom is None:
        return {}
    blocks = {m: weight_format(recipe.format_of(m)).input_block for m in targets if recipe.format_of(m)}
    return {m: (recipe.act_headroom, block) for m, block in blocks.items() if block}
