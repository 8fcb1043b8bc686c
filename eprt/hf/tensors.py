"""The tensors of a Hugging Face export, each produced on demand, and the unquantized ones."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from eprt.checkpoint import Checkpoint
from eprt.config import reader_for
from eprt.safetensors_io import SafetensorsFile


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


def source_tensors(ck: Checkpoint) -> Iterator[OutTensor]:
    """Every source tensor under its Hugging Face name and dtype, stacked experts split back."""
    layout = reader_for(ck.config.model_type, ck.path).layout(ck.config)
    specs = {s.name: s for s in layout.specs}
    for name, meta in ck.tensors.items():
        spec = specs.get(name)
        dtype = meta.source_dtype
        as_stored = meta.dtype == dtype and meta.encoding == "raw"
        if spec is None or not spec.stacked:
            stored = (lambda n=name: ck.byte_range(n)) if as_stored and len(meta.parts) == 1 else None
            yield OutTensor(name, dtype, meta.shape, lambda n=name, d=dtype: ck.read(n).to(d), stored)
            continue
        h = spec.source_shape()[0]
        for j, src in enumerate(spec.sources):
            e, k = divmod(j, spec.per_row)
            # expert e's row holds its per_row source tensors end to end
            stored = (lambda n=name, e=e, k=k, m=spec.per_row: row_part(ck, n, e, k, m)) if as_stored else None
            yield OutTensor(src, dtype, spec.source_shape(),
                            lambda n=name, e=e, a=k * h, b=(k + 1) * h, d=dtype: ck.read(n, rows=(e, e + 1))[0, a:b].to(d),
                            stored)


def row_part(ck: Checkpoint, name: str, row: int, k: int, per_row: int) -> tuple[SafetensorsFile, int, int]:
    """The k-th of `per_row` equal pieces of row `row` of a stacked tensor."""
    f, offset, n = ck.byte_range(name, row)
    return f, offset + k * (n // per_row), n // per_row
