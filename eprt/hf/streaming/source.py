"""A Hugging Face directory as the model-free export reads it: every tensor by its name, in the
order the source stores them, and a weight the source stores encoded (block FP8, any
compressed-tensors format eprt decodes: eprt.storage.encodings; an encoding a family registers:
eprt.storage.source_decoders) as the one decoded `M.weight` in place of its components, decoded
when it is read, one weight at a time (one expert of a stack, where its decoder decodes stacks).
Only headers are read to list them (and one weight per encoding scheme, to learn what it decodes
to)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch

from eprt.families import read_hf_config
from eprt.hf.convert import ConversionPlanner
from eprt.hf.source import HFSource, non_weight_files
from eprt.hf.source_encoded import Encoded
from eprt.layout import Layout, TensorSpec
from eprt.storage import encodings
from eprt.storage.hf_files import CONFIG
from eprt.storage.safetensors_io import SafetensorsFile


@dataclass(frozen=True)
class SourceTensor:
    name: str  # as the source names it; `M.weight` for the components of an encoded M
    dtype: torch.dtype  # as read: an encoded weight's decoded dtype
    shape: tuple[int, ...]
    file: str  # the shard holding it (an encoded weight: its first component's)
    encoded: Encoded | None = None

    @property
    def nbytes(self) -> int:
        return self.dtype.itemsize * math.prod(self.shape)


class StreamSource:
    """The tensors of Hugging Face directory `hf_dir`, decoded; `layout`: its family's, where eprt
    models it (convert's planner then checks the source against it)."""

    def __init__(self, hf_dir: str, layout: Layout | None = None):
        self.dir = hf_dir
        self.config = read_hf_config(hf_dir)
        self.quant = encodings.source_quantization(self.config, os.path.join(hf_dir, CONFIG))
        self.src = HFSource(hf_dir)
        try:
            self.planner = ConversionPlanner(self.src, layout, None, hf_dir, self.quant)
            self.tensors = self._decoded_names()
            self.files = non_weight_files(hf_dir)
            # fused stacks read in eprt's order, each expert [out, in] with its pieces apart (a stack
            # stored transposed, [E, in, out]; GPT-OSS's gate and up interleaved), by name: the
            # spec whose `from_fused` undoes the stored order
            self.permuted: dict[str, TensorSpec] = {}
        except BaseException:
            self.src.close()
            raise

    def _decoded_names(self) -> dict[str, SourceTensor]:
        owner = {n: m for m, e in self.planner.encoded.items() for n in e.components.values()}
        out: dict[str, SourceTensor] = {}
        for name, (f, info) in self.src.tensors.items():
            module = owner.get(name)
            if module is None:
                out[name] = SourceTensor(name, info.dtype, tuple(info.shape), os.path.basename(f.path))
            elif self.planner.encoded[module].weight not in out:
                e = self.planner.encoded[module]
                dtype, shape = self.planner.probe(e)
                out[e.weight] = SourceTensor(e.weight, dtype, shape, os.path.basename(f.path), e)
        return out

    def read(self, name: str, index: int | None = None) -> torch.Tensor:
        """Tensor `name` (decoded), or entry `index` along its dim 0 only (one expert of a stacked
        tensor); a fused stack stored in another order (`permuted`) in eprt's: [E, out, in], pieces apart
        (a view of what was read: the format's arithmetic copies it as it needs, as fast as the stored order)."""
        t = self.tensors[name]
        rows = (index, index + 1) if index is not None else None
        if t.encoded is None:
            f, _ = self.src.tensors[name]
            w = f.read(name, rows=rows)
        else:
            w = self._decoded(t, rows)
        spec = self.permuted.get(name)
        w = spec.from_fused(w) if spec is not None else w
        return w[0] if index is not None else w

    def read_shape(self, name: str) -> tuple[int, ...]:
        """The shape of tensor `name` as `read` gives it whole: a permuted stack's in eprt's order."""
        spec = self.permuted.get(name)
        shape = self.tensors[name].shape
        return (*shape[:-2], shape[-1], shape[-2]) if spec is not None and spec.transposed else shape

    def _decoded(self, t: SourceTensor, rows: tuple[int, int] | None) -> torch.Tensor:
        """An encoded tensor decoded, or its entries `rows` along dim 0: from those rows of its
        components alone where each leads with them (a batched decoder's fused experts)."""
        e = t.encoded
        self.planner.probe(e)  # the scheme's decoder, made once
        decoder = self.planner.decoders[(e.encoding, e.scheme)]
        if rows is None or not getattr(decoder, "batched", False):
            w = decoder.decode({c: self.src.tensors[n][0].read(n) for c, n in e.components.items()})
            return w[rows[0] : rows[1]] if rows is not None else w
        # one expert of a stack a batched decoder decodes alike: its rows of each component stacked as
        # the weight is (a component of one value for every expert, whole), not every expert's
        parts = {}
        for c, n in e.components.items():
            f, info = self.src.tensors[n]
            stacked = len(info.shape) > 0 and info.shape[0] == t.shape[0]
            parts[c] = f.read(n, rows=rows) if stacked else f.read(n)
        return decoder.decode(parts)

    def byte_range(self, name: str, index: int | None = None) -> tuple[SafetensorsFile, int, int]:
        """Where a stored tensor's bytes lie (one entry along dim 0 with `index`), to copy them as they are."""
        f, _ = self.src.tensors[name]
        return (f, *f.byte_range(name, (index, index + 1) if index is not None else None))

    @property
    def bytes_read(self) -> int:
        return self.src.bytes_read

    def close(self) -> None:
        self.src.close()

    def __enter__(self) -> "StreamSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
