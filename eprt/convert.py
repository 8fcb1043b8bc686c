"""Hugging Face safetensors -> eprt checkpoint, streamed one tensor at a time.

Every check (config, headers, names, shapes, dtypes) runs before the first byte is written;
then each output file is filled tensor by tensor. A stacked expert tensor [E, 2I, H] is the
per-expert gate and up tensors laid end to end, so it is written by copying each source
tensor in turn: memory holds one source tensor, never a layer.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from dataclasses import dataclass

import torch

from eprt.atomic import atomic_output_dir, copy_files
from eprt.checkpoint import HF_FILES, Part, TensorMeta, manifest, write_manifest
from eprt.config import load_hf_config, reader_for
from eprt.errors import CheckpointError, ConfigError
from eprt.hf.source import HFSource, non_weight_files
from eprt.layout import Layout, TensorSpec, layer_of, plain
from eprt.progress import bar, logger
from eprt.safetensors_io import SafetensorsWriter

DTYPE_CHOICES = {"keep": None, "bf16": torch.bfloat16, "fp32": torch.float32}
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class Planned:
    spec: TensorSpec
    source_dtype: torch.dtype
    dtype: torch.dtype
    role: str


def file_for(name: str, role: str) -> str:
    layer = layer_of(name)
    prefix = "passthrough" if role == "passthrough" else "layer"
    if layer is None:
        return "passthrough.safetensors" if role == "passthrough" else "model.safetensors"
    return f"{prefix}-{layer:05d}.safetensors"


def plan(src: HFSource, layout: Layout, dtype: torch.dtype | None, where: str) -> list[Planned]:
    """Check the source against the layout and decide every output tensor's dtype; refuse on any mismatch."""
    by_source = layout.by_source()
    planned = []
    for spec in layout.specs:
        missing = [s for s in spec.sources if s not in src.tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise CheckpointError(f"{where}: tensor {missing[0]!r}{more} is missing; config.json says the model has it")
        dtypes = set()
        for s in spec.sources:
            f, info = src.tensors[s]
            if info.shape != spec.source_shape():
                raise CheckpointError(f"{f.path}: tensor {s!r} has shape {list(info.shape)} but config.json "
                                      f"implies {list(spec.source_shape())}")
            dtypes.add(info.dtype)
        if len(dtypes) > 1:
            raise CheckpointError(f"{where}: the tensors stacked into {spec.name!r} have different dtypes "
                                  f"{sorted(map(str, dtypes))}; convert with --dtype bf16 or fp32")
        (sdt,) = dtypes
        planned.append(Planned(spec, sdt, out_dtype(sdt, dtype, layout.is_precise(spec.name)), "model"))
    unread = []
    for name, (f, info) in src.tensors.items():
        if name in by_source:
            continue
        if layout.is_passthrough(name):
            planned.append(Planned(plain(name, *info.shape), info.dtype, out_dtype(info.dtype, dtype, False), "passthrough"))
        else:
            unread.append((f.path, name))
    if unread:
        path, name = unread[0]
        more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
        raise CheckpointError(f"{path}: tensor {name!r}{more}: nothing in the model reads it; the checkpoint "
                              f"does not match its config.json (wrong num_hidden_layers, experts or layer types?)")
    return planned


def out_dtype(source: torch.dtype, want: torch.dtype | None, precise: bool) -> torch.dtype:
    return want if want is not None and source in _CASTABLE and not precise else source


def convert_hf(hf_dir: str, out_dir: str, *, dtype: str = "keep", overwrite: bool = False,
               progress: bool = True) -> str:
    """Convert a Hugging Face directory into an eprt checkpoint at `out_dir`; returns its path."""
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"{hf_dir}: not a directory")
    hf_cfg, cfg = load_hf_config(hf_dir)
    layout = reader_for(cfg.model_type, hf_dir).layout(cfg)
    src = HFSource(hf_dir)
    try:
        planned = plan(src, layout, DTYPE_CHOICES[dtype], hf_dir)
        by_file: dict[str, list[Planned]] = defaultdict(list)
        for p in planned:
            by_file[file_for(p.spec.name, p.role)].append(p)
        with atomic_output_dir(out_dir, overwrite=overwrite, inputs=(hf_dir,)) as tmp:
            metas = write_files(src, by_file, tmp, progress)
            files = copy_hf_files(hf_dir, tmp)
            write_manifest(tmp, manifest(cfg.family, cfg, hf_cfg, metas, files, converted_with={"dtype": dtype}))
    finally:
        src.close()
    logger().info("converted %s -> %s (%d tensors)", hf_dir, out_dir, len(planned))
    return out_dir


def write_files(src: HFSource, by_file: dict[str, list[Planned]], tmp: str, progress: bool) -> list[TensorMeta]:
    metas = []
    total = sum(p.dtype.itemsize * math.prod(p.spec.shape) for ps in by_file.values() for p in ps)
    with bar(total, "convert", unit="B", enabled=progress) as pb:
        for fname, ps in by_file.items():
            w = SafetensorsWriter(os.path.join(tmp, fname), [(p.spec.name, p.dtype, p.spec.shape) for p in ps])
            for p in ps:
                for s in p.spec.sources:
                    f, info = src.tensors[s]
                    if info.dtype == p.dtype:
                        w.copy_range(p.spec.name, f, info.start, info.nbytes)
                    else:
                        w.write(p.spec.name, f.read(s).to(p.dtype))
                    pb.update(p.dtype.itemsize * math.prod(info.shape))
                rows = (0, p.spec.shape[0] if p.spec.shape else 0)
                metas.append(TensorMeta(p.spec.name, p.dtype, p.spec.shape, "raw", p.role,
                                        (Part(fname, p.spec.name, rows),), p.source_dtype))
            w.close()
    return metas


def copy_hf_files(hf_dir: str, tmp: str) -> list[str]:
    """Copy every non-weight file of the source byte for byte into `hf/`."""
    files = non_weight_files(hf_dir)
    copy_files(hf_dir, files, os.path.join(tmp, HF_FILES))
    return files
