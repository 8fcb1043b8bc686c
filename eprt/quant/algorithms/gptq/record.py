"""GPTQ's part of the calibration record (eprt.quant.calibrated.RecordPart): the quantized weight of each
module it changed, in the export's encoding (FP8: float8_e4m3fn codes; NVFP4: packed E2M1 codes, the
scales being the export's from the original weight). A dense Linear's is `MODULE.gptq_weight` [out, in or
in/2]; a routed experts module's `MODULE.gptq_w13` and `MODULE.gptq_w2` (the first projection's [E, 2I or
I, ...], down's [E, D, ...]: the gated shape's names for every shape), each rank writing its own experts'
rows. Read back they are not loaded (the whole model's weights): `weight` reads one at a time."""

from __future__ import annotations

import torch

from eprt.layout import EXPERT_LEAVES
from eprt.quant.calibrated import RecordPart
from eprt.storage.checkpoint import Checkpoint

WEIGHT, W13, W2 = "gptq_weight", "gptq_w13", "gptq_w2"


class GPTQRecord(RecordPart):
    leaves = (WEIGHT, W13, W2)
    per_rank = (W13, W2)

    def __init__(
        self,
        dense: dict[str, torch.Tensor | None],
        experts: dict[str, tuple[torch.Tensor, torch.Tensor] | None],
    ):
        """`dense`: Linear -> codes; `experts`: experts module -> (first projection's codes, down's) of
        this rank's experts; None where read back by name only."""
        self.dense, self.experts = dense, experts

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {}
        for module, (codes_in, codes_down) in self.experts.items():
            out[f"{module}.{W13}"], out[f"{module}.{W2}"] = codes_in, codes_down
        return {**out, **{f"{m}.{WEIGHT}": t for m, t in self.dense.items()}}

    @classmethod
    def read(cls, ck: Checkpoint, names: list[str]) -> GPTQRecord:
        modules = lambda leaf: {n.rsplit(".", 1)[0]: None for n in names if n.endswith(f".{leaf}")}  # noqa: E731
        return cls(modules(WEIGHT), modules(W13))

    def weight(self, ck: Checkpoint, module: str, kind: str | None = None, expert: int | None = None):
        if kind is None:
            return ck.read(f"{module}.{WEIGHT}") if module in self.dense else None
        if module not in self.experts:
            return None
        leaf = (W13, W2)[EXPERT_LEAVES[kind][0]]
        return ck.read(f"{module}.{leaf}", rows=(expert, expert + 1))[0]
