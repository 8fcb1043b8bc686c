"""AWQ's scales folded into the weights: what a run and its export read in place of the checkpoint's.

AWQ (eprt.quant.algorithms.awq.passes) finds, for a group of Linears that read one tensor (a norm's output, a
gated MLP's activation), a scale s per channel of it, and folds it so that the model computes the
same in exact arithmetic: what makes the tensor (the norm's weight, the up projection's rows, which
the SwiGLU activation passes through linearly) divided by s, every reader's weight columns
multiplied by s (the router's too, whose logits are then unchanged). The export is a plain
checkpoint of folded weights; no engine sees s.

AWQ's clipping half (eprt.quant.algorithms.awq.clip) is a fold too: a step per quantization block that
clips the block to a fraction of its amax, applied after the scales, to the rounded weight they
make. It changes what the model computes unquantized, on purpose: the export's block-amax rule
then gives the clipped block its smaller scale.

A fold is one tensor changed: `Folds` holds them by tensor name, `FoldedCheckpoint` reads a
checkpoint with them applied. The calibration run reads its layers through it (GPTQ's weights and
scales, the quantized layer's), and so does the export, so both quantize the same folded tensors.
Each folded tensor is rounded once, to the dtype the checkpoint stores it in.
"""

from __future__ import annotations

import torch

from eprt.layout import TensorSpec
from eprt.quant.calibrated import RecordPart
from eprt.storage.checkpoint import Checkpoint

# a fold's kind, the leaf of its scale in the calibration record -> the leaf of the tensor it changes
COLUMNS = "awq_columns"  # a Linear's (or router's) weight [out, in]: columns * s [in]
ROWS = "awq_rows"  # a Linear's weight [out, in]: rows / s [out] (a gated MLP's up_proj)
NORM = "awq_norm"  # an RMSNorm's weight: / s
CENTERED_NORM = "awq_centered_norm"  # a zero-centered RMSNorm's weight w, which scales by 1 + w: (1 + w) / s - 1
W13_COLUMNS = "awq_w13_columns"  # the routed experts' stacked gate/up [E, 2I, in]: columns * s [in]
W13_UP_ROWS = "awq_w13_up_rows"  # their up rows (the second half): / s [E, I], each expert its own
W2_COLUMNS = "awq_w2_columns"  # their down [E, D, I]: columns * s [E, I]
# AWQ's clipping (eprt.quant.algorithms.awq.clip): each quantization block of a weight clipped to a fraction of
# its own amax, the fraction's step per block (uint8 [..., in / block]); the scales' folds first
CLIP = "awq_clip"  # a Linear's weight [out, in]
W13_CLIP = "awq_w13_clip"  # the routed experts' w13 [E, 2I, in]: a step per expert's block
W2_CLIP = "awq_w2_clip"  # their w2 [E, D, I]
CLIPS = (CLIP, W13_CLIP, W2_CLIP)
TENSOR_LEAF = {
    COLUMNS: "weight",
    ROWS: "weight",
    NORM: "weight",
    CENTERED_NORM: "weight",
    W13_COLUMNS: "w13",
    W13_UP_ROWS: "w13",
    W2_COLUMNS: "w2",
    CLIP: "weight",
    W13_CLIP: "w13",
    W2_CLIP: "w2",
}
# s [E, ...]: a read of rows [a, b) of the tensor takes s[a:b]
PER_EXPERT = (W13_UP_ROWS, W2_COLUMNS, W13_CLIP, W2_CLIP)
# The routed experts' clips, a byte per 16 of their weights: each rank holds its own
# experts' rows (ExpertRows) and the calibrated checkpoint stores them with its share, as GPTQ's
# codes; their scales (a vector per expert) every rank holds whole
HELD_PER_RANK = (W13_CLIP, W2_CLIP)
CLIP_GRID = 20  # a clip's step k bounds its block by (1 - k / CLIP_GRID) x the block's amax


def fold(folds: list[tuple[str, torch.Tensor]], t: torch.Tensor, rows: tuple[int, int] | None = None) -> torch.Tensor:
    """Tensor `t` (rows `rows` of a stacked one) with `folds` (kind, s) applied: the scales in fp32,
    rounded once to t's dtype, then the clip (`clipped`), which AWQ's clipping search chose on the
    weight the scales' fold made."""
    scales = [(kind, s) for kind, s in folds if kind not in CLIPS]
    w = _scaled(scales, t, rows) if scales else t
    for kind, steps in folds:
        if kind in CLIPS:
            steps = _rows(steps, rows).to(t.device)
            w = clipped(w, steps if t.dim() == steps.dim() else steps[0])  # one expert's row, read alone
    return w


def clipped(w: torch.Tensor, steps: torch.Tensor) -> torch.Tensor:
    """w [..., in] with each block of in / steps.shape[-1] elements clipped to (1 - k / CLIP_GRID)
    of its own amax, k its step of `steps` [..., blocks] (0: as it is), in fp32, rounded to w's dtype."""
    blocks = w.float().reshape(*steps.shape, -1)
    bound = blocks.abs().amax(-1, keepdim=True).mul_(1.0 - steps.float().unsqueeze(-1) / CLIP_GRID)
    return torch.minimum(torch.maximum(blocks, -bound), bound).reshape(w.shape).to(w.dtype)


class ExpertRows:
    """Rows of a routed experts' fold [E, ...] that one holder has: this rank's experts' rows `t`
    (`first` the first's id), or, with `read` (rows [a, b) -> tensor), the calibrated checkpoint's,
    read as asked."""

    def __init__(self, t: torch.Tensor | None, first: int = 0, read=None):
        self.t, self.first, self.read = t, first, read

    def rows(self, a: int, b: int) -> torch.Tensor:
        if self.read is not None:
            return self.read(a, b)
        if not self.first <= a <= b <= self.first + self.t.shape[0]:
            raise ValueError(
                f"rows [{a}, {b}) of a routed experts' clips held for experts [{self.first}, "
                f"{self.first + self.t.shape[0]}): a rank reads only its own experts"
            )
        return self.t[a - self.first : b - self.first]


def _rows(s: torch.Tensor | ExpertRows, rows: tuple[int, int] | None) -> torch.Tensor:
    """Rows `rows` of fold s (None: all of it, which a rank's rows are not)."""
    if isinstance(s, ExpertRows):
        if rows is None:
            raise ValueError("a routed experts' clips are read a range of experts at a time")
        return s.rows(*rows)
    return s if rows is None else s[rows[0] : rows[1]]


def _scaled(folds: list[tuple[str, torch.Tensor]], t: torch.Tensor, rows: tuple[int, int] | None) -> torch.Tensor:
    w = t.float()
    for kind, s in folds:
        s = s.float().to(t.device)
        if kind in PER_EXPERT:
            s = s if rows is None else s[rows[0] : rows[1]]
            s = s if t.dim() == s.dim() + 1 else s[0]  # one expert's row, read as [2I, D] or [D, I]
        if kind in (COLUMNS, W13_COLUMNS):
            w = w * s
        elif kind == W2_COLUMNS:
            w = w * s.unsqueeze(-2)
        elif kind == ROWS:
            w = w / s[:, None]
        elif kind == W13_UP_ROWS:
            width = s.shape[-1]
            w = torch.cat([w[..., :width, :], w[..., width:, :] / s.unsqueeze(-1)], dim=-2)
        elif kind == NORM:
            w = w / s
        else:
            w = (1.0 + w) / s - 1.0
    return w.to(t.dtype)


class Folds(RecordPart):
    """The folds of a run by the module they change (module -> {kind: s fp32}), and by the tensor.
    The routed experts' clips (HELD_PER_RANK) are ExpertRows: the rows of experts `first` onwards
    (this rank's), or the calibrated checkpoint's. AWQ's part of the calibration record: `module.kind`
    -> s (one per channel; the routed experts: a row per expert), the export reading the checkpoint
    through them (`view`)."""

    leaves = tuple(TENSOR_LEAF)
    per_rank = HELD_PER_RANK

    def __init__(self, first: int = 0):
        self.first = first
        self.by_module: dict[str, dict[str, torch.Tensor | ExpertRows]] = {}
        self.by_tensor: dict[str, list[tuple[str, torch.Tensor | ExpertRows]]] = {}

    def add(self, module: str, kind: str, s: torch.Tensor) -> str:
        """Fold `s` into `module` as `kind` says; returns the tensor it changes."""
        name = f"{module}.{TENSOR_LEAF[kind]}"
        if kind in self.by_module.setdefault(module, {}):
            raise ValueError(f"{module}: AWQ folds {kind} into it twice")
        self.by_module[module][kind] = s
        # in the order of their kinds, however they were added: a run and its resume fold alike
        self.by_tensor[name] = sorted([*self.by_tensor.get(name, []), (kind, s)], key=lambda f: f[0])
        return name

    def tensor_names(self) -> list[str]:
        return sorted(self.by_tensor)

    def apply(self, name: str, t: torch.Tensor, rows: tuple[int, int] | None = None, clip: bool = True) -> torch.Tensor:
        """Tensor `name` as read (or rows of it), folded where a fold changes it (without the clip: the
        weight GPTQ's rounding aims at, under the clipped weight's scales)."""
        folds = self.by_tensor.get(name)
        if folds is not None and not clip:
            folds = [(kind, s) for kind, s in folds if kind not in CLIPS] or None
        return t if folds is None else fold(folds, t, rows)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The calibration record's tensors: `module.kind` -> s (the routed experts' clips: this
        rank's rows)."""
        return {
            f"{m}.{k}": s.t if isinstance(s, ExpertRows) else s
            for m, kinds in self.by_module.items()
            for k, s in kinds.items()
        }

    @classmethod
    def of(cls, tensors: dict[str, torch.Tensor | None], read=None) -> Folds:
        """The folds of `tensors`: a calibrated checkpoint's, whose routed experts' clips (None
        there) `read(name, rows)` reads as asked, or every expert's whole."""
        folds = cls()
        for name, t in sorted(tensors.items()):
            if t is None:
                module, kind = name.rsplit(".", 1)
                folds.add(module, kind, ExpertRows(None, read=lambda a, b, n=name: read(n, (a, b))))
        folds.load({n: t for n, t in tensors.items() if t is not None})
        return folds

    @classmethod
    def read(cls, ck: Checkpoint, names: list[str]) -> Folds:
        """The folds of calibrated checkpoint `ck`, the routed experts' clips read by rows from it."""
        tensors = {n: None if n.rsplit(".", 1)[1] in HELD_PER_RANK else ck.read(n) for n in names}
        return cls.of(tensors, read=lambda name, rows: ck.read(name, rows=rows))

    def view(self, ck: Checkpoint) -> FoldedCheckpoint:
        return FoldedCheckpoint(ck, self)

    def load(self, tensors: dict[str, torch.Tensor]) -> None:
        """Back from `tensors` (eprt.quant.run.workdir's saved ones: the routed experts' clips this
        rank's rows): `module.kind` -> s."""
        for name, s in sorted(tensors.items()):
            module, kind = name.rsplit(".", 1)
            if kind not in self.by_module.get(module, {}):
                self.add(module, kind, ExpertRows(s.cpu(), self.first) if kind in HELD_PER_RANK else s.cpu())


class FoldedCheckpoint:
    """Checkpoint `ck` read with `folds` applied; everything else is `ck`'s."""

    def __init__(self, ck: Checkpoint, folds: Folds):
        self._ck, self.folds = ck, folds

    def __getattr__(self, name: str):
        return getattr(self._ck, name)

    def read(self, name: str, rows: tuple[int, int] | None = None, device=None) -> torch.Tensor:
        """Folded on the host, where the folds are: `device` is not used."""
        return self.folds.apply(name, self._ck.read(name, rows), rows)

    def read_unclipped(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` with the scales' folds and not the clip's."""
        return self.folds.apply(name, self._ck.read(name, rows), rows, clip=False)

    def read_expert(self, spec: TensorSpec, e: int) -> torch.Tensor:
        if spec.name in self._ck.tensors:
            return self.read(spec.name, rows=(e, e + 1))[0]
        return self._ck.read_expert(spec, e)  # a multi-token-prediction layer's: AWQ leaves them as they are
