"""A checkpoint as a run reads it, resolved once: the family that reads it, its tensor layout, the
routed experts this rank holds and the dtype each tensor runs in.

What builds, loads or prices the model asks this object, not the family table (the model class
is `family.model`), and `place_tensors` is the one path that reads tensors into a
model's places, the decoder layers' and the multi-token-prediction layers' alike.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
from torch import nn

from eprt.errors import ConfigError
from eprt.families import Family, reader_for
from eprt.layout import Layout, TensorSpec
from eprt.models.moe import held_experts
from eprt.storage.checkpoint import Checkpoint


@dataclass(frozen=True)
class ResolvedCheckpoint:
    ck: Checkpoint
    family: Family
    layout: Layout
    expert_range: tuple[int, int]  # (first, count) of the routed experts the model holds
    dtype: torch.dtype  # the dtype the model runs in, but for the tensors the reference keeps in fp32

    @classmethod
    def of(cls, ck: Checkpoint, dtype: torch.dtype, expert_range: tuple[int, int] | None = None) -> ResolvedCheckpoint:
        """`ck` resolved for a model in `dtype` holding routed experts `expert_range` (default: all)."""
        fam = reader_for(ck.config.model_type, ck.path)
        return cls(ck, fam, fam.layout(ck.config), (0, 0), dtype).holding(expert_range)  # (0, 0): settled there

    def holding(self, expert_range: tuple[int, int] | None) -> ResolvedCheckpoint:
        """The same resolution for a model holding routed experts `expert_range` (default: all)."""
        c = self.ck.config
        first, count = held_experts(expert_range, c.num_experts)
        if c.moe_layers and not (0 <= first and 0 < count and first + count <= c.num_experts):
            raise ConfigError(
                f"expert_range ({first}, {count}) is outside the {c.num_experts} experts of {self.ck.path}"
            )
        return dataclasses.replace(self, expert_range=(first, count))

    def run_dtype(self, name: str) -> torch.dtype:
        """The dtype tensor `name` runs in: fp32 where the reference keeps it so, else the run's."""
        return torch.float32 if self.family.keeps_fp32(name) else self.dtype

    @functools.cached_property
    def stacked(self) -> frozenset[str]:
        """The decoder layers' stacked routed-expert tensors, of which a rank reads its rows."""
        return frozenset(s.name for s in self.layout.specs if s.is_expert)

    @functools.cached_property
    def mtp_stacked(self) -> dict[str, TensorSpec]:
        """The MTP layers' stacked routed experts, which convert carries through under their Hugging
        Face names: read expert by expert from their source tensors."""
        return {s.name: s for s in self.layout.mtp if s.stacked}

    def source_dtype(self, name: str) -> torch.dtype:
        """The dtype the source holds tensor `name` in; an MTP layer's stacked experts: their source tensors'."""
        return self.ck.meta(self.source_tensor(name)).source_dtype

    def source_tensor(self, name: str) -> str:
        """Tensor `name` as the checkpoint names it; an MTP layer's stacked experts, which it holds
        under their Hugging Face names: the first of their source tensors."""
        return name if name in self.ck.tensors else self.mtp_stacked[name].sources[0]

    def read(self, name: str, slot: torch.Tensor, device=None) -> torch.Tensor:
        """Tensor `name` as stored, the part of it `slot` holds: this rank's rows of routed experts,
        the model's leading entries of a padded tensor (Kimi-K3's A_log); a source encoding that
        decodes anywhere decoded on `device` (eprt.storage.checkpoint.Checkpoint.read)."""
        first, count = self.expert_range
        if name in self.stacked:
            return self.ck.read(name, rows=(first, first + count), device=device)
        if name in self.mtp_stacked:
            return torch.stack([self.ck.read_expert(self.mtp_stacked[name], e) for e in range(first, first + count)])
        if slot.shape and self.ck.meta(name).shape[0] > slot.shape[0]:
            return self.ck.read(name, rows=(0, slot.shape[0]), device=device)
        return self.ck.read(name, device=device)


def place_tensors(
    rc: ResolvedCheckpoint, model: nn.Module, names: list[str], *, device, prefix: str = "", read=None
) -> int:
    """Read checkpoint tensors `names` into their places in `model` (where tensor `prefix + x` is
    model's `x`), each in its run dtype on `device`, one tensor in flight; returns the bytes placed.
    `read`: the tensors already read (by name, as `rc.read` returns them), placed instead."""
    placed = 0
    for name in names:
        module, _, attr = name[len(prefix) :].rpartition(".")
        owner = model.get_submodule(module)
        t = read[name] if read is not None else rc.read(name, getattr(owner, attr), device)
        # an integer table (eprt.layout.TensorSpec.table) runs in its own dtype
        t = t.to(device=device, dtype=rc.run_dtype(name) if t.is_floating_point() else t.dtype)
        owner.load_state_dict({attr: t}, strict=False, assign=True)
        placed += t.numel() * t.element_size()
    return placed
