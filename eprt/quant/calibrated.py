"""Writing a calibrated checkpoint: the calibration record, the recipe, and a reference to the base.

The weights are not copied: the manifest names the input checkpoint, the SHA-256 of its
manifest and a pin of each of its weight files (eprt.storage.pins.weight_pin), checked whenever
the calibrated checkpoint is opened. Rank 0 writes the dense and KV
amax and the manifest; the first replica of each expert shard (edp rank 0) writes its own
experts' rows of the stacked per-expert record, so nothing is gathered.
"""

from __future__ import annotations

import json
import os

import torch

from eprt.errors import CheckpointError, ConfigError
from eprt.parallel import ParallelState
from eprt.quant.algorithms.registry import record_parts
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.recipe import Recipe
from eprt.report import checked, label, page_path, write_page
from eprt.storage.atomic import atomic_file
from eprt.storage.checkpoint import Checkpoint, Part, TensorMeta, base_reference, manifest, write_manifest
from eprt.storage.safetensors_io import save_tensors

DENSE_FILE = "calibration.safetensors"
QUALITY_FILE = "quality.json"  # the quality report (eprt.quant.quality)


def experts_file(ep_rank: int) -> str:
    return f"calibration-experts-{ep_rank:05d}.safetensors"


class RecordPart:
    """One algorithm's part of the calibration record: its own tensors, under names that are a format
    (its module names them), each either written by rank 0 or, with a rank's routed experts' rows,
    by each rank (`per_rank`) and read back by name only."""

    leaves: tuple[str, ...] = ()  # the record tensors' leaves it owns: `module.LEAF`
    per_rank: tuple[str, ...] = ()  # of those, the ones stored with the routed experts' rows

    def tensors(self) -> dict[str, torch.Tensor]:
        """This rank's tensors, by record name, in the order they are written."""
        return {}

    @classmethod
    def read(cls, ck: Checkpoint, names: list[str]) -> RecordPart:
        """The part of calibrated checkpoint `ck` whose tensors are `names`."""
        return cls()

    def view(self, ck: Checkpoint) -> Checkpoint:
        """`ck` as the export reads it once this part applies (AWQ's folds); `ck` where it changes no weight."""
        return ck

    def weight(self, ck: Checkpoint, module: str, kind: str | None = None, expert: int | None = None):
        """The export's codes this part decided for dense Linear `module`, or for routed expert `expert`'s
        stacked projection `kind` (eprt.layout.EXPERT_LEAVES), read from `ck`; None where it decided none."""
        return None


class CalibrationRecord:
    """What calibration found, by module, and the one place that names its tensors.

    input_amax: dense Linear -> scalar amax of its input; expert_input_amax: experts module ->
    (input amax [E], activation amax [E]: what the first stacked projection and down read), one
    row per expert; expert_tokens: experts module ->
    tokens routed to each expert [E]; kv_amax: attention module -> (k amax, v amax).

    `parts`: each algorithm's own part by its name (RecordPart, made in its module: GPTQ's codes,
    AWQ's folds), in the registry's order (eprt.quant.algorithms.registry.record_parts), which is the
    order their tensors are written in."""

    INPUT, W13_INPUT, W2_INPUT, TOKENS, K, V = (
        "input_amax",
        "w13_input_amax",
        "w2_input_amax",
        "tokens",
        "k_amax",
        "v_amax",
    )

    def __init__(
        self,
        input_amax=None,
        expert_input_amax=None,
        expert_tokens=None,
        kv_amax=None,
        parts: dict[str, RecordPart] | None = None,
    ):
        self.input_amax: dict[str, torch.Tensor] = input_amax or {}
        self.expert_input_amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = expert_input_amax or {}
        self.expert_tokens: dict[str, torch.Tensor] = expert_tokens or {}
        self.kv_amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = kv_amax or {}
        self.parts: dict[str, RecordPart] = parts or {}

    @classmethod
    def of(cls, cal: Calibrator, parts: dict[str, RecordPart] | None = None) -> CalibrationRecord:
        return cls(cal.input_amax, cal.expert_amax, cal.expert_tokens, cal.kv_amax, parts)

    def _parts_tensors(self, per_rank: bool) -> dict[str, torch.Tensor]:
        return {
            n: t
            for part in self.parts.values()
            for n, t in part.tensors().items()
            if (n.rsplit(".", 1)[1] in part.per_rank) == per_rank
        }

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-expert tensor of the record (this rank's rows, during calibration), by name."""
        out = {}
        for module, (x_amax, h_amax) in self.expert_input_amax.items():
            out[f"{module}.{self.W13_INPUT}"] = x_amax
            out[f"{module}.{self.W2_INPUT}"] = h_amax
            out[f"{module}.{self.TOKENS}"] = self.expert_tokens[module]
        return {**out, **self._parts_tensors(per_rank=True)}

    def dense_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"{m}.{self.INPUT}": t for m, t in self.input_amax.items()}
        for attn, (k, v) in self.kv_amax.items():
            out[f"{attn}.{self.K}"], out[f"{attn}.{self.V}"] = k, v
        return {**out, **self._parts_tensors(per_rank=False)}

    @classmethod
    def read(cls, ck: Checkpoint) -> CalibrationRecord:
        """The record of a calibrated checkpoint: the statistics read, each algorithm's part as it reads
        its own (eprt.quant.algorithms.registry.record_parts)."""
        owners = {leaf: name for name, part in record_parts().items() for leaf in part.leaves}
        by: dict[str, dict[str, torch.Tensor]] = {}  # leaf -> module -> tensor
        of_part: dict[str, list[str]] = {}
        for name in ck.names(role="calibration"):
            module, leaf = name.rsplit(".", 1)
            if leaf in owners:
                of_part.setdefault(owners[leaf], []).append(name)
            elif leaf in (cls.INPUT, cls.W13_INPUT, cls.W2_INPUT, cls.TOKENS, cls.K, cls.V):
                by.setdefault(leaf, {})[module] = ck.read(name)
            else:
                raise CheckpointError(
                    f"calibration state tensor *.{leaf}: not one eprt writes; calibrate again with this eprt"
                )
        get = lambda leaf: by.get(leaf, {})  # noqa: E731
        experts = {m: (x_amax, get(cls.W2_INPUT)[m]) for m, x_amax in get(cls.W13_INPUT).items()}
        kv = {m: (k, get(cls.V)[m]) for m, k in get(cls.K).items()}
        parts = {name: part.read(ck, of_part[name]) for name, part in record_parts().items() if name in of_part}
        return cls(dict(get(cls.INPUT)), experts, dict(get(cls.TOKENS)), kv, parts)

    def view(self, ck: Checkpoint) -> Checkpoint:
        """`ck` as the export reads it: through every part's view, in turn."""
        for part in self.parts.values():
            ck = part.view(ck)
        return ck

    def weight(self, ck: Checkpoint, module: str, kind: str | None = None, expert: int | None = None):
        """The export's codes an algorithm decided for `module` (RecordPart.weight); None where none did."""
        return next((w for p in self.parts.values() if (w := p.weight(ck, module, kind, expert)) is not None), None)


def refuse_calibrated(ck: Checkpoint, path: str) -> None:
    """PTQ quantizes an unquantized checkpoint: refuse (and close) calibrated `ck`, opened from `path`."""
    if ck.quantization is not None:
        ck.close()
        raise ConfigError(f"{path} is already calibrated; run PTQ on the unquantized checkpoint")


def write_calibrated(
    tmp: str,
    out: str,
    state: ParallelState,
    cal: Calibrator,
    ck: Checkpoint,
    recipe: Recipe,
    summary: dict,
    quality: dict | None = None,
    parts: dict[str, RecordPart] | None = None,
) -> None:
    """Every rank calls this with the same shared temp directory `tmp` (published later as `out`).
    The quality report, when there is one, goes into QUALITY_FILE, which the manifest's
    quantization section names (`quality`); `parts`: the algorithms' own (CalibrationRecord.parts)."""
    cs = CalibrationRecord.of(cal, parts)
    experts = cs.expert_tensors()
    if experts and state.edp_rank == 0:
        save_tensors(os.path.join(tmp, experts_file(state.ep_rank)), experts)
    if state.rank != 0:
        return
    dense = cs.dense_tensors()
    save_tensors(os.path.join(tmp, DENSE_FILE), dense)
    metas = [
        TensorMeta(
            n,
            t.dtype,
            tuple(t.shape),
            "raw",
            "calibration",
            (Part(DENSE_FILE, n, (0, t.shape[0] if t.dim() else 0)),),
            t.dtype,
        )
        for n, t in dense.items()
    ]
    place = state.placement(ck.config.num_experts)
    for n, t in experts.items():
        parts = tuple(
            Part(experts_file(r), n, (first, first + count)) for r, (first, count) in enumerate(place.ranges())
        )
        metas.append(TensorMeta(n, t.dtype, (place.num_experts, *t.shape[1:]), "raw", "calibration", parts, t.dtype))
    quantization = {"recipe": recipe.to_json(), "calibration": summary}
    if quality is not None:
        with atomic_file(os.path.join(tmp, QUALITY_FILE)) as f:
            json.dump(quality, f, indent=1)
        shown = checked(quality, f"{out}/{QUALITY_FILE}")  # as a page too, through the schema every page is drawn by
        write_page(page_path(os.path.join(tmp, QUALITY_FILE)), [(label(shown), shown)])
        quantization["quality"] = QUALITY_FILE
    write_manifest(
        tmp,
        manifest(
            ck.family,
            ck.config,
            ck.source_config,
            metas,
            ck.hf_files,
            base=base_reference(out, ck.path),
            quantization=quantization,
        ),
    )
