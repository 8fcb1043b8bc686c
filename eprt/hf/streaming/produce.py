"""The output tensors of one shard of the model-free export, each produced when it is written:
a carried tensor copied from where the source stores it (or decoded), a quantized Linear read,
scaled and encoded by its format (eprt.quant.formats), with the scales the modeled export gives it
(eprt.quant.scales): a per-tensor weight scale, where the format has one, from the amax of the
Linears sharing it (a routed expert's fused projections: their joint weight's, or the scale that
keeps an MXFP4 source's values exactly; the dense Linears the engines fuse: their largest amax),
and the input scale a format pins. Each weight is read once: one read for its group's amax is
kept until it is quantized (a group split between two shards is read by each of their writers).
"""

from __future__ import annotations

import functools

import torch

from eprt.hf import compressed_tensors_export as ct
from eprt.hf.streaming.plan import Carried, Quantized, StreamPlan
from eprt.hf.streaming.selection import Linear
from eprt.hf.streaming.source import StreamSource
from eprt.hf.tensors import OutTensor
from eprt.quant.numerics import abs_amax


class Producer:
    """Makes the OutTensors of plan items; `layout` is the export layout (modelopt or compressed-tensors)."""

    def __init__(self, src: StreamSource, plan: StreamPlan, layout: str):
        self.src, self.plan, self.layout = src, plan, layout
        self.format_of = {q.linear: q for q in plan.items if isinstance(q, Quantized)}
        # weights read for their scale group's amax, kept until they are quantized: each is read once
        self.held: dict[Linear, torch.Tensor] = {}

    def read(self, x: Linear) -> torch.Tensor:
        w = self.src.read(x.source, x.index)
        return w[x.rows[0] : x.rows[1]] if x.rows is not None else w

    def group_weights(self, group: tuple) -> list[torch.Tensor]:
        members = self.plan.groups[group]
        for x in members:
            if x not in self.held:
                self.held[x] = self.read(x)
        return [self.held[x] for x in members]

    @functools.lru_cache(maxsize=64)
    def group_amax(self, group: tuple) -> torch.Tensor:
        return max(abs_amax(w) for w in self.group_weights(group))

    @functools.lru_cache(maxsize=64)
    def expert_scale(self, group: tuple) -> torch.Tensor:
        """The per-tensor scale of a routed expert's fused projections, from their joint weight."""
        q = self.format_of[self.plan.groups[group][0]]
        row = torch.cat(self.group_weights(group))
        exact = q.format.exact_weight_scale(row)
        if exact is not None:
            return exact
        return q.format.mse_weight_scale(row, abs_amax(row)) if q.mse else q.format.scale(abs_amax(row))

    def weight_scale(self, q: Quantized) -> torch.Tensor:
        """The per-tensor weight scale of `q` (its group's weights are read and held for it)."""
        fmt, group = q.format, q.linear.group
        if fmt.weight_scale_leaf is None:  # no per-tensor scale: the format's blocks carry it all
            return fmt.scale(torch.zeros(()))
        if group[0] != "linear":
            return self.expert_scale(group)
        amax = self.group_amax(group)
        return fmt.mse_weight_scale(self.held[q.linear], amax) if q.mse else fmt.scale(amax)

    @functools.lru_cache(maxsize=2)
    def quantize(self, q: Quantized) -> dict[str, torch.Tensor]:
        """Every tensor of one quantized Linear, by its ModelOpt leaf."""
        scale = self.weight_scale(q)
        w = self.held.pop(q.linear, None)
        out = q.format.quantize(w if w is not None else self.read(q.linear), scale, q.mse)
        if q.format.pinned_input_scale() is not None:
            out["input_scale"] = q.format.pinned_input_scale()
        return out

    def tensors(self, item) -> list[OutTensor]:
        if isinstance(item, Carried):
            return [self.carried(item)]
        out_dim, in_dim = item.linear.shape
        fmt, name = item.format, item.linear.name
        if self.layout == ct.NAME:
            return [
                OutTensor(f"{name}.{k}", dtype, shape, lambda k=k: fmt.to_compressed_tensors(self.quantize(item))[k])
                for k, (dtype, shape) in fmt.compressed_tensors_tensors(out_dim, in_dim).items()
            ]
        return [
            OutTensor(f"{name}.{k}", dtype, shape, lambda k=k: self.quantize(item)[k])
            for k, (dtype, shape) in fmt.modelopt_tensors(out_dim, in_dim).items()
        ]

    def carried(self, c: Carried) -> OutTensor:
        t = self.src.tensors[c.source]
        shape = self.src.read_shape(c.source)
        shape = shape[1:] if c.index is not None else shape
        if c.rows is not None:
            shape = (c.rows[1] - c.rows[0], *shape[1:])
        as_stored = t.encoded is None and c.rows is None and c.source not in self.src.permuted
        return OutTensor(
            c.name,
            t.dtype,
            tuple(shape),
            lambda: self.piece(c),
            (lambda: self.src.byte_range(c.source, c.index)) if as_stored else None,
        )

    def piece(self, c: Carried) -> torch.Tensor:
        w = self.src.read(c.source, c.index)
        return w[c.rows[0] : c.rows[1]] if c.rows is not None else w
