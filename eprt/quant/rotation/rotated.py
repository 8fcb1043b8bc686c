"""A checkpoint read rotated: what a run with `rotate` and its export read in place of the checkpoint.

The rotations are data-free and exact in real arithmetic (eprt.quant.rotation.plan), so they are a
view of the checkpoint, as AWQ's folds are (eprt.quant.algorithms.awq.folds): each tensor the plan changes is
read, its steps applied in fp64 (the norms it reads folded in, then the rotation of each axis),
and rounded once to the dtype the checkpoint stores it in. Calibration reads its layers through
the view, AWQ's folds and GPTQ's weights sit on top of it, and the export reads the same view:
a plain checkpoint of rotated weights and identity norms, which any engine loads unchanged.
"""

from __future__ import annotations

import functools

import torch

from eprt.errors import ConfigError
from eprt.families.family import next_layers
from eprt.layout import TensorSpec
from eprt.loading.loader import build_meta
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.progress import logger
from eprt.quant.rotation.hadamard import Rotation, random_hadamard, rotate
from eprt.quant.rotation.plan import R1_SEED, R2_SEED, Identity, PerHead, Residual, RotationPlan, Step, rotation_plan
from eprt.storage.checkpoint import Checkpoint


def plan_of(ck: Checkpoint) -> RotationPlan:
    """The rotation plan of `ck`'s model (built on the meta device); refuses a tensor the export
    carries through untouched outside the MTP layers (a vision tower), and MTP layers other than
    DeepSeek-V3's (the plan's `mtp`), which would read or write the rotated stream unrotated."""
    rc = ResolvedCheckpoint.of(ck, torch.float32)
    c = ck.config
    plan = rotation_plan(build_meta(rc))  # first: what the decoder's own structure refuses
    if rc.layout.mtp and rc.family.mtp_prefix is not next_layers:
        raise ConfigError(
            f"algorithm rotate: the rotation knows DeepSeek-V3's multi-token-prediction layers, not {c.family}'s "
            f"({rc.layout.mtp[0].name}, ...), which would see the rotated residual stream unrotated; quantize "
            "without rotate"
        )
    for name, meta in ck.tensors.items():
        if meta.role == "passthrough" and not name.startswith(plan.mtp):
            raise ConfigError(
                f"algorithm rotate: {name} is carried through the export untouched and would see the rotated "
                "residual stream unrotated; quantize without rotate"
            )
    return plan


PIECE_ROWS = 4096  # rows (or columns) of a tensor rotated at a time: 4096 x 7168 in fp64 is 235 MB


def say_rotation(plan: RotationPlan, rank: int) -> None:
    """Log, on rank 0, what the rotation reads and what it leaves unrotated."""
    if rank != 0:
        return
    log = logger()
    log.info("rotate: %d tensors read rotated (residual stream width %d)", len(plan.steps), plan.width)
    for line in plan.left_out:
        log.info("rotate: %s", line)


class RotatedCheckpoint:
    """Checkpoint `ck` read through rotation plan `plan`; everything else is `ck`'s."""

    def __init__(self, ck: Checkpoint, plan: RotationPlan | None = None):
        self._ck = ck
        self.plan = plan if plan is not None else plan_of(ck)
        self.residual = random_hadamard(self.plan.width, R1_SEED)

    def __getattr__(self, name: str):
        return getattr(self._ck, name)

    def rotated(self, name: str) -> bool:
        """Whether tensor `name` is not its stored bytes."""
        return name in self.plan.steps

    def read(self, name: str, rows: tuple[int, int] | None = None, device=None) -> torch.Tensor:
        """Rotated on the host, in fp64: `device` is not used."""
        t = self._ck.read(name, rows)
        steps = self.plan.steps.get(name)
        return t if steps is None else self.apply(steps, t)

    def read_expert(self, spec: TensorSpec, e: int) -> torch.Tensor:
        return Checkpoint.read_expert(self, spec, e)  # through this view's `read`

    def apply(self, steps: tuple[Step, ...], t: torch.Tensor) -> torch.Tensor:
        """`t` with `steps` applied in fp64, rounded once to t's dtype; a piece at a time where the
        steps leave pieces apart (a stack of routed experts one expert at a time, the rows of a
        tensor every step rotates along its last dim, the columns of one rotated along its rows),
        so the fp64 copy is of a piece, not of a routed-expert stack or an embedding table."""
        axes = {s.axis for s in steps if not isinstance(s, Identity)}
        if t.dim() == 3:
            return torch.stack([self.apply(steps, x) for x in t])
        if t.dim() == 2 and axes == {-1}:
            return torch.cat([self.apply_whole(steps, x) for x in t.split(PIECE_ROWS)])
        if t.dim() == 2 and axes == {-2}:
            return torch.cat([self.apply_whole(steps, x) for x in t.split(PIECE_ROWS, dim=1)], dim=1)
        return self.apply_whole(steps, t)

    def apply_whole(self, steps: tuple[Step, ...], t: torch.Tensor) -> torch.Tensor:
        w = t.to(torch.float64)
        for step in steps:
            if isinstance(step, Identity):
                w = torch.full_like(w, step.value)
            elif isinstance(step, Residual):
                w = along(w, step.axis, lambda x, s=step: self.residual_rotate(x, s))
            else:
                w = along(w, step.axis, lambda x, s=step: per_head(x, s, head_rotation(s.width)))
        return w.to(t.dtype)

    def residual_rotate(self, x: torch.Tensor, step: Residual) -> torch.Tensor:
        """x [..., len(norms) x D] (or [..., D]): each run of D scaled by its norm, then rotated."""
        if not step.norms:
            return rotate(x, self.residual)
        runs = x.split(self.plan.width, dim=-1)
        return torch.cat(
            [rotate(r * self.norm_scale(n.name, n.centered), self.residual) for r, n in zip(runs, step.norms)], -1
        )

    @functools.lru_cache(maxsize=None)
    def norm_scale(self, name: str, centered: bool) -> torch.Tensor:
        """What norm `name` multiplies by as stored: w, or 1 + w."""
        w = self._ck.read(name).to(torch.float64)
        return 1.0 + w if centered else w


def along(w: torch.Tensor, axis: int, f) -> torch.Tensor:
    """f over `axis` (-1 or -2) of w, as f sees a last dimension."""
    return f(w) if axis == -1 else f(w.transpose(-1, -2)).transpose(-1, -2)


def per_head(x: torch.Tensor, step: PerHead, r: Rotation) -> torch.Tensor:
    """x [..., heads x period]: entries [offset, offset + width) of each run of `period` rotated by r."""
    lead = x.shape[:-1]
    y = x.reshape(*lead, -1, step.period).clone()
    y[..., step.offset : step.offset + step.width] = rotate(y[..., step.offset : step.offset + step.width], r)
    return y.reshape(*lead, -1)


@functools.lru_cache(maxsize=8)
def head_rotation(width: int) -> Rotation:
    return random_hadamard(width, R2_SEED)
