"""Writing a calibrated checkpoint: the calibration state, the recipe, and a reference to the base.

The weights are not copied: the manifest names the input checkpoint, the SHA-256 of its
manifest and a pin of each of its weight files (eprt.storage.checkpoint.weight_pin), checked whenever
the calibrated checkpoint is opened. Rank 0 writes the dense and KV
amax and the manifest; the first replica of each expert shard (edp rank 0) writes its own
experts' rows of the stacked per-expert state, so nothing is gathered.
"""

from __future__ import annotations

import json
import os

import torch

from eprt.errors import CheckpointError
from eprt.quant.calibrate import Calibrator
from eprt.quant.recipe import Recipe
from eprt.storage.checkpoint import Checkpoint, Part, TensorMeta, base_reference, manifest, write_manifest
from eprt.storage.safetensors_io import save_tensors

DENSE_FILE = "calibration.safetensors"
QUALITY_FILE = "quality.json"  # the quality report (eprt.quant.quality)


def experts_file(ep_rank: int) -> str:
    return f"calibration-experts-{ep_rank:05d}.safetensors"


class CalibrationState:
    """The calibration state by module, and the one place that names its tensors.

    input_amax: dense Linear -> scalar amax of its input; expert_input_amax: experts module ->
    (w13 input amax [E], w2 input amax [E]), one row per expert; expert_tokens: experts module ->
    tokens routed to each expert [E]; kv_amax: attention module -> (k amax, v amax)."""

    INPUT, W13_INPUT, W2_INPUT, TOKENS, K, V = "input_amax", "w13_input_amax", "w2_input_amax", "tokens", "k_amax", "v_amax"

    def __init__(self, input_amax=None, expert_input_amax=None, expert_tokens=None, kv_amax=None):
        self.input_amax: dict[str, torch.Tensor] = input_amax or {}
        self.expert_input_amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = expert_input_amax or {}
        self.expert_tokens: dict[str, torch.Tensor] = expert_tokens or {}
        self.kv_amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = kv_amax or {}

    @classmethod
    def of(cls, cal: Calibrator) -> "CalibrationState":
        return cls(cal.input_amax, cal.expert_amax, cal.expert_tokens, cal.kv_amax)

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-expert state tensor (this rank's rows, during calibration), by name."""
        out = {}
        for module, (w13_in, w2_in) in self.expert_input_amax.items():
            out[f"{module}.{self.W13_INPUT}"] = w13_in
            out[f"{module}.{self.W2_INPUT}"] = w2_in
            out[f"{module}.{self.TOKENS}"] = self.expert_tokens[module]
        return out

    def dense_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"{m}.{self.INPUT}": t for m, t in self.input_amax.items()}
        for attn, (k, v) in self.kv_amax.items():
            out[f"{attn}.{self.K}"], out[f"{attn}.{self.V}"] = k, v
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor]) -> "CalibrationState":
        """The state back from its tensors by name (what `expert_tensors` and `dense_tensors` wrote)."""
        by: dict[str, dict[str, torch.Tensor]] = {}  # leaf -> module -> tensor
        for name, t in tensors.items():
            module, leaf = name.rsplit(".", 1)
            by.setdefault(leaf, {})[module] = t
        get = lambda leaf: by.get(leaf, {})  # noqa: E731
        unknown = set(by) - {cls.INPUT, cls.W13_INPUT, cls.W2_INPUT, cls.TOKENS, cls.K, cls.V}
        if unknown:
            raise CheckpointError(f"calibration state tensor *.{sorted(unknown)[0]}: not one eprt writes; "
                                  "calibrate again with this eprt")
        experts = {m: (w13, get(cls.W2_INPUT)[m]) for m, w13 in get(cls.W13_INPUT).items()}
        kv = {m: (k, get(cls.V)[m]) for m, k in get(cls.K).items()}
        return cls(dict(get(cls.INPUT)), experts, dict(get(cls.TOKENS)), kv)

    @classmethod
    def read(cls, ck: Checkpoint) -> "CalibrationState":
        return cls.from_tensors({n: ck.read(n) for n in ck.names(role="calibration")})


def write_calibrated(tmp: str, out: str, state, cal: Calibrator, ck: Checkpoint, recipe: Recipe,
                     summary: dict, quality: dict | None = None) -> None:
    """Every rank calls this with the same shared temp directory `tmp` (published later as `out`).
    The quality report, when there is one, goes into QUALITY_FILE, which the manifest's
    quantization section names (`quality`)."""
    cs = CalibrationState.of(cal)
    experts = cs.expert_tensors()
    if experts and state.edp_rank == 0:
        save_tensors(os.path.join(tmp, experts_file(state.ep_rank)), experts)
    if state.rank != 0:
        return
    dense = cs.dense_tensors()
    save_tensors(os.path.join(tmp, DENSE_FILE), dense)
    metas = [TensorMeta(n, t.dtype, tuple(t.shape), "raw", "calibration", (Part(DENSE_FILE, n, (0, 0)),), t.dtype)
             for n, t in dense.items()]
    place = state.placement(ck.config.num_experts)
    for n, t in experts.items():
        parts = tuple(Part(experts_file(r), n, (first, first + count))
                      for r, (first, count) in enumerate(place.ranges()))
        metas.append(TensorMeta(n, t.dtype, (place.num_experts,), "raw", "calibration", parts, t.dtype))
    quantization = {"recipe": recipe.to_json(), "calibration": summary}
    if quality is not None:
        with open(os.path.join(tmp, QUALITY_FILE), "w", encoding="utf-8") as f:
            json.dump(quality, f, indent=1)
        quantization["quality"] = QUALITY_FILE
    write_manifest(tmp, manifest(
        ck.family, ck.config, ck.source_config, metas, ck.hf_files,
        base=base_reference(out, ck.path), quantization=quantization))
