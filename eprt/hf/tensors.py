"""The tensors of a Hugging Face export, each produced on demand, and the unquantized ones."""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial
from typing import Callable, Iterator

import torch

from eprt.layout import Layout, TensorSpec
from eprt.storage.checkpoint import Checkpoint, TensorMeta
from eprt.storage.encodings import component_names
from eprt.storage.safetensors_io import SafetensorsFile


@dataclass(frozen=True)
class OutTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    produce: Callable[[], torch.Tensor]
    # Where the bytes already lie as they must be written: (file, offset, length), copied in the kernel.
    stored: Callable[[], tuple[SafetensorsFile, int, int]] | None = None

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


def source_tensors(
    ck: Checkpoint, layout: Layout, *, dequantize: bool = False, per_expert: bool = False
) -> Iterator[OutTensor]:
    """Every source tensor of `ck` (whose tensor layout is `layout`) under its Hugging Face name and
    dtype, stacked experts split back.

    Only the source's tensors (roles `model` and `passthrough`): a calibrated checkpoint's
    calibration state (amax, expert token counts) is eprt's own, no engine loads it, and the
    quantized export turns it into scales instead.

    A weight the source stores encoded (compressed, block FP8) is written back as its source
    tensors, byte for byte; with `dequantize`, as the one decoded weight instead (in the dtype it
    decodes to), refused up front if it cannot be decoded here.

    Routed experts the source held fused (one tensor per projection) are written back fused,
    unless `per_expert` (the quantized export: engines load quantized experts per expert)."""
    specs = {s.name: s for s in layout.specs}
    if dequantize:
        ck.check_decode(role=None)

    # An expert's gate and up are written one after the other: their row is read (decoded) once.
    @lru_cache(maxsize=1)
    def expert_row(name: str, e: int) -> torch.Tensor:
        return ck.read(name, rows=(e, e + 1))[0]

    for name, meta in ck.tensors.items():
        if meta.role == "calibration":
            continue
        spec = specs.get(name)
        if meta.encoded and not dequantize:
            yield from encoded_sources(ck, meta, spec)
            continue
        dtype = meta.source_dtype
        as_stored = meta.dtype == dtype and not meta.encoded
        if spec is not None and spec.stacked and meta.fused_source and not per_expert and spec.permuted:
            # fused experts the source stores transposed or interleaved: its order back
            read = lambda n=name, d=dtype, s=spec: s.to_fused(ck.read(n).to(d))  # noqa: E731
            yield OutTensor(meta.fused_source, dtype, spec.fused_shape(), read)
            continue
        if spec is None or not spec.stacked or (meta.fused_source and not per_expert):
            stored = (lambda n=name: ck.byte_range(n)) if as_stored and len(meta.parts) == 1 else None
            yield OutTensor(
                meta.fused_source or name, dtype, meta.shape, lambda n=name, d=dtype: ck.read(n).to(d), stored
            )
            continue
        h = spec.source_shape()[0]
        for j, src in enumerate(spec.sources):
            e, k = divmod(j, spec.per_row)
            # expert e's row holds its per_row source tensors end to end
            stored = (lambda n=name, e=e, k=k, m=spec.per_row: ck.piece_range(n, e, k, m)) if as_stored else None
            yield OutTensor(
                src,
                dtype,
                spec.source_shape(),
                lambda n=name, e=e, a=k * h, b=(k + 1) * h, d=dtype: expert_row(n, e)[a:b].to(d),
                stored,
            )


def encoded_sources(ck: Checkpoint, meta: TensorMeta, spec: TensorSpec | None) -> Iterator[OutTensor]:
    """The source tensors of an encoded weight (`M.weight_packed`, ... for each source weight
    `M.weight`), each copied from where it lies."""
    name = meta.name
    if meta.per_row is None:
        # fused experts whose source alternates gate and up along the outputs: that order back
        interleaved = spec is not None and meta.fused_source is not None and spec.interleaved > 1
        for c, source in component_names(meta.fused_source or name, meta.components).items():
            x = meta.components[c]
            if interleaved:
                read = lambda c=c: spec.interleave(ck.read_component(name, c)).contiguous()  # noqa: E731
                yield OutTensor(source, x.dtype, x.source_shape, read)
                continue
            yield OutTensor(
                source,
                x.dtype,
                x.source_shape,
                partial(ck.read_component, name, c),
                partial(ck.byte_range, name, None, c),
            )
        return
    for j, src in enumerate(spec.sources):
        e, k = divmod(j, meta.per_row)
        module = src[: -len(".weight")]
        for c, x in meta.components.items():
            yield OutTensor(
                f"{module}.{c}",
                x.dtype,
                x.source_shape,
                partial(component_piece, ck, name, c, e, k),
                partial(ck.piece_range, name, e, k, meta.per_row, c),
            )


def component_piece(ck: Checkpoint, name: str, component: str, row: int, k: int) -> torch.Tensor:
    """The k-th source tensor of one stored component in row `row` of a stacked encoded tensor."""
    return ck.meta(name).components[component].piece(ck.read_component(name, component, (row, row + 1))[0], k)
