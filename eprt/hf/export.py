"""eprt checkpoint -> Hugging Face directory: sharded safetensors with an index, plus every non-weight file.

The writer takes a list of output tensors, each with a function that produces it, so that the
unquantized export here and a quantized export share sharding, indexing and atomic output.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Callable, Iterator

import torch

from eprt.atomic import atomic_output_dir, copy_files
from eprt.checkpoint import Checkpoint
from eprt.config import reader_for
from eprt.hf.source import INDEX
from eprt.progress import bar, logger
from eprt.safetensors_io import SafetensorsFile, SafetensorsWriter

DEFAULT_SHARD_BYTES = 5 * 1024**3


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
            stored = (lambda n=name: whole(ck, n)) if as_stored and len(meta.parts) == 1 else None
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


def whole(ck: Checkpoint, name: str) -> tuple[SafetensorsFile, int, int]:
    p = ck.meta(name).parts[0]
    f = ck.file(p.file)
    return (f, *f.byte_range(p.key))


def row_part(ck: Checkpoint, name: str, row: int, k: int, per_row: int) -> tuple[SafetensorsFile, int, int]:
    """The k-th of `per_row` equal pieces of row `row` of a stacked tensor."""
    f, offset, n = ck.byte_range(name, row)
    return f, offset + k * (n // per_row), n // per_row


def shard(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    shards, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    return shards + [cur] if cur else shards


def write_hf_dir(tmp: str, tensors: list[OutTensor], *, max_shard_bytes: int, progress: bool) -> dict:
    """Write the shards and the index into `tmp`; returns the weight map."""
    shards = shard(tensors, max_shard_bytes)
    weight_map = {}
    with bar(sum(t.nbytes for t in tensors), "export", unit="B", enabled=progress) as pb:
        for i, group in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            w = SafetensorsWriter(os.path.join(tmp, fname), [(t.name, t.dtype, t.shape) for t in group])
            for t in group:
                if t.stored is not None:
                    w.copy_range(t.name, *t.stored())
                else:
                    w.write(t.name, t.produce())
                weight_map[t.name] = fname
                pb.update(t.nbytes)
            w.close()
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": dict(sorted(weight_map.items()))}
    with open(os.path.join(tmp, INDEX), "w") as f:
        json.dump(index, f, indent=2)
        f.flush()
        os.fsync(f.fileno())
    return weight_map


def export_hf(ckpt_dir: str, out_dir: str, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              overwrite: bool = False, progress: bool = True) -> str:
    """Write an unquantized eprt checkpoint back in its source's Hugging Face layout."""
    ck = Checkpoint(ckpt_dir)
    try:
        tensors = list(source_tensors(ck))
        with atomic_output_dir(out_dir, overwrite=overwrite, inputs=(ckpt_dir,)) as tmp:
            write_hf_dir(tmp, tensors, max_shard_bytes=max_shard_bytes, progress=progress)
            copy_files(ck.hf_files_dir(), ck.manifest["files"], tmp)
    finally:
        ck.close()
    logger().info("exported %s -> %s (%d tensors)", ckpt_dir, out_dir, len(tensors))
    return out_dir
