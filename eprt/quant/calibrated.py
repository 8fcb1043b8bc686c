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
from eprt.layout import EXPERT_LEAVES
from eprt.parallel import ParallelState
from eprt.quant.algorithms.awq.folds import HELD_PER_RANK, TENSOR_LEAF, Folds
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


class CalibrationRecord:
    """What calibration found, by module, and the one place that names its tensors.

    input_amax: dense Linear -> scalar amax of its input; expert_input_amax: experts module ->
    (input amax [E], activation amax [E]: what the first stacked projection and down read), one
    row per expert; expert_tokens: experts module ->
    tokens routed to each expert [E]; kv_amax: attention module -> (k amax, v amax).

    With GPTQ (eprt.quant.algorithms.gptq.solve), the quantized weight of each module it changed, in the export's
    encoding (FP8: float8_e4m3fn codes; NVFP4: packed E2M1 codes, the scales being the export's
    from the original weight): gptq_dense: dense Linear -> codes [out, in or in/2]; gptq_experts:
    experts module -> (first projection's codes [E, 2I or I, ...], down's [E, D, ...]). Read back, they are not loaded
    (the whole model's weights): their values are None and `read_gptq` reads one at a time.

    With AWQ (eprt.quant.algorithms.awq.passes), its scales: folds: `module.kind` -> s (one per channel; the
    routed experts: a row per expert), each kind one of
    eprt.quant.algorithms.awq.folds.TENSOR_LEAF (what the fold does to the module's weight); the export reads
    the checkpoint through them (eprt.quant.algorithms.awq.folds.FoldedCheckpoint, `read_folds`). The routed
    experts' clips (eprt.quant.algorithms.awq.folds.HELD_PER_RANK) are per-expert tensors, each rank's rows
    written with its share like GPTQ's codes, and read back by rows, as the export asks."""

    INPUT, W13_INPUT, W2_INPUT, TOKENS, K, V = (
        "input_amax",
        "w13_input_amax",
        "w2_input_amax",
        "tokens",
        "k_amax",
        "v_amax",
    )
    # the experts' tensors carry the gated shape's names for every shape: the first projection's, down's
    GPTQ_WEIGHT, GPTQ_W13, GPTQ_W2 = "gptq_weight", "gptq_w13", "gptq_w2"
    GPTQ = (GPTQ_WEIGHT, GPTQ_W13, GPTQ_W2)

    def __init__(
        self,
        input_amax=None,
        expert_input_amax=None,
        expert_tokens=None,
        kv_amax=None,
        gptq_dense=None,
        gptq_experts=None,
        folds=None,
    ):
        self.input_amax: dict[str, torch.Tensor] = input_amax or {}
        self.expert_input_amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = expert_input_amax or {}
        self.expert_tokens: dict[str, torch.Tensor] = expert_tokens or {}
        self.kv_amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = kv_amax or {}
        self.gptq_dense: dict[str, torch.Tensor | None] = gptq_dense or {}
        self.gptq_experts: dict[str, tuple[torch.Tensor, torch.Tensor] | None] = gptq_experts or {}
        self.folds: dict[str, torch.Tensor | None] = folds or {}

    @classmethod
    def of(cls, cal: Calibrator, gptq=None, folds: Folds | None = None) -> "CalibrationRecord":
        """`gptq`: eprt.quant.algorithms.gptq.layer.GPTQResults, when GPTQ ran; `folds`: AWQ's, when it ran."""
        dense, experts = (gptq.dense, gptq.experts) if gptq is not None else (None, None)
        awq = folds.tensors() if folds is not None else None
        return cls(cal.input_amax, cal.expert_amax, cal.expert_tokens, cal.kv_amax, dense, experts, awq)

    def expert_tensors(self) -> dict[str, torch.Tensor]:
        """Every per-expert tensor of the record (this rank's rows, during calibration), by name."""
        out = {}
        for module, (x_amax, h_amax) in self.expert_input_amax.items():
            out[f"{module}.{self.W13_INPUT}"] = x_amax
            out[f"{module}.{self.W2_INPUT}"] = h_amax
            out[f"{module}.{self.TOKENS}"] = self.expert_tokens[module]
        for module, (codes_in, codes_down) in self.gptq_experts.items():
            out[f"{module}.{self.GPTQ_W13}"], out[f"{module}.{self.GPTQ_W2}"] = codes_in, codes_down
        out.update({n: t for n, t in self.folds.items() if _per_rank(n)})
        return out

    def dense_tensors(self) -> dict[str, torch.Tensor]:
        out = {f"{m}.{self.INPUT}": t for m, t in self.input_amax.items()}
        for attn, (k, v) in self.kv_amax.items():
            out[f"{attn}.{self.K}"], out[f"{attn}.{self.V}"] = k, v
        out.update({f"{m}.{self.GPTQ_WEIGHT}": t for m, t in self.gptq_dense.items()})
        out.update({n: t for n, t in self.folds.items() if not _per_rank(n)})
        return out

    @classmethod
    def from_tensors(cls, tensors: dict[str, torch.Tensor | None]) -> "CalibrationRecord":
        """The record back from its tensors by name (what `expert_tensors` and `dense_tensors` wrote)."""
        by: dict[str, dict[str, torch.Tensor]] = {}  # leaf -> module -> tensor
        for name, t in tensors.items():
            module, leaf = name.rsplit(".", 1)
            by.setdefault(leaf, {})[module] = t
        get = lambda leaf: by.get(leaf, {})  # noqa: E731
        unknown = set(by) - {cls.INPUT, cls.W13_INPUT, cls.W2_INPUT, cls.TOKENS, cls.K, cls.V, *cls.GPTQ, *TENSOR_LEAF}
        if unknown:
            raise CheckpointError(
                f"calibration state tensor *.{sorted(unknown)[0]}: not one eprt writes; calibrate again with this eprt"
            )
        experts = {m: (x_amax, get(cls.W2_INPUT)[m]) for m, x_amax in get(cls.W13_INPUT).items()}
        kv = {m: (k, get(cls.V)[m]) for m, k in get(cls.K).items()}
        gptq_experts = {m: (codes, get(cls.GPTQ_W2)[m]) for m, codes in get(cls.GPTQ_W13).items()}
        folds = {f"{m}.{kind}": s for kind in TENSOR_LEAF for m, s in get(kind).items()}
        return cls(
            dict(get(cls.INPUT)), experts, dict(get(cls.TOKENS)), kv, dict(get(cls.GPTQ_WEIGHT)), gptq_experts, folds
        )

    @classmethod
    def read(cls, ck: Checkpoint) -> "CalibrationRecord":
        """The record of a calibrated checkpoint; GPTQ's weights and the routed experts' clips by
        name only (`read_gptq`, `read_folds`)."""
        return cls.from_tensors(
            {
                n: None if n.rsplit(".", 1)[1] in cls.GPTQ or _per_rank(n) else ck.read(n)
                for n in ck.names(role="calibration")
            }
        )

    def read_folds(self, ck: Checkpoint) -> Folds:
        """AWQ's folds of calibrated checkpoint `ck`, the routed experts' clips read by rows from it."""
        return Folds.of(self.folds, read=lambda name, rows: ck.read(name, rows=rows))

    def read_gptq(
        self, ck: Checkpoint, module: str, kind: str | None = None, expert: int | None = None
    ) -> torch.Tensor:
        """GPTQ's codes of dense Linear `module`, or of routed expert `expert`'s stacked projection `kind`
        (eprt.layout.EXPERT_LEAVES)."""
        if kind is None:
            return ck.read(f"{module}.{self.GPTQ_WEIGHT}")
        leaf = (self.GPTQ_W13, self.GPTQ_W2)[EXPERT_LEAVES[kind][0]]
        return ck.read(f"{module}.{leaf}", rows=(expert, expert + 1))[0]


def _per_rank(name: str) -> bool:
    """Whether record tensor `name` is a routed experts' clip: written by rank, read by rows."""
    return name.rsplit(".", 1)[1] in HELD_PER_RANK


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
    gptq=None,
    folds: Folds | None = None,
) -> None:
    """Every rank calls this with the same shared temp directory `tmp` (published later as `out`).
    The quality report, when there is one, goes into QUALITY_FILE, which the manifest's
    quantization section names (`quality`); `gptq` (eprt.quant.algorithms.gptq.layer.GPTQResults): GPTQ's
    codes, when it ran; `folds`: AWQ's scales, when it ran."""
    cs = CalibrationRecord.of(cal, gptq, folds)
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
