"""The eprt checkpoint format, version 1.

A directory holding
- `eprt.json`, the manifest: format name and version, family, the normalized config, the
  source config.json verbatim, and a table of every tensor: dtype, shape, encoding, role, and
  where its bytes are (`parts`: file, key in that file, rows [a, b) along dim 0);
- safetensors files, one per decoder layer plus one for the rest, routed experts stacked
  with the expert index leading, so a reader of rows [a, b) touches only those bytes;
- `hf/`: every non-weight file of the source (config, tokenizer, generation config, ...).

A calibrated checkpoint holds no weights of its own: its manifest names a `base` checkpoint
(path and the SHA-256 of its manifest, verified on open) whose tensors it reads, and adds the
calibration state (role `calibration`) and the recipe (`quantization`).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass

import torch

from eprt.config import ModelConfig
from eprt.errors import CheckpointError
from eprt.safetensors_io import DTYPES, SafetensorsFile, dtype_name

FORMAT = "eprt"
VERSION = 1
MANIFEST = "eprt.json"
HF_FILES = "hf"


@dataclass(frozen=True)
class Part:
    file: str
    key: str
    rows: tuple[int, int]


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    encoding: str  # "raw": the bytes are the tensor
    role: str  # "model": the model runs it; "passthrough": carried for export only
    parts: tuple[Part, ...]
    source_dtype: torch.dtype  # what the source stored; export writes this dtype back

    def to_json(self) -> dict:
        return {
            "dtype": dtype_name(self.dtype), "source_dtype": dtype_name(self.source_dtype),
            "shape": list(self.shape), "encoding": self.encoding, "role": self.role,
            "parts": [{"file": p.file, "key": p.key, "rows": list(p.rows)} for p in self.parts],
        }

    @classmethod
    def from_json(cls, name: str, d: dict) -> "TensorMeta":
        parts = tuple(Part(p["file"], p["key"], tuple(p["rows"])) for p in d["parts"])
        return cls(name, DTYPES[d["dtype"]], tuple(d["shape"]), d["encoding"], d["role"], parts,
                   DTYPES[d["source_dtype"]])


def manifest(family: str, config: ModelConfig, source_config: dict, tensors: list[TensorMeta],
             files: list[str], **extra) -> dict:
    return {
        "format": FORMAT, "version": VERSION, "family": family,
        "config": config.to_json(), "source_config": source_config,
        "tensors": {t.name: t.to_json() for t in tensors}, "files": files, **extra,
    }


def write_manifest(directory: str, m: dict) -> None:
    path = os.path.join(directory, MANIFEST)
    with open(path, "w") as f:
        json.dump(m, f, indent=1)
        f.flush()
        os.fsync(f.fileno())


class Checkpoint:
    """Read access to an eprt checkpoint: any tensor, or any rows of it, straight from disk."""

    def __init__(self, path: str):
        self.path = path
        mpath = os.path.join(path, MANIFEST)
        if not os.path.isfile(mpath):
            raise CheckpointError(f"{path}: no {MANIFEST}; not an eprt checkpoint (convert one with tools/convert_hf.py)")
        try:
            with open(mpath) as f:
                m = json.load(f)
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{mpath}: corrupt manifest ({e})") from None
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise CheckpointError(f"{mpath}: format {m.get('format')!r} version {m.get('version')!r}; "
                                  f"this eprt reads {FORMAT!r} version {VERSION}")
        self.manifest = m
        self.family: str = m["family"]
        self.config = ModelConfig.from_json(m["config"])
        self.source_config: dict = m["source_config"]
        self.base = open_base(path, m["base"]) if "base" in m else None
        own = {n: TensorMeta.from_json(n, d) for n, d in m["tensors"].items()}
        self._own = set(own)
        self.tensors = {**(self.base.tensors if self.base else {}), **own}
        self._files: dict[str, SafetensorsFile] = {}

    @property
    def quantization(self) -> dict | None:
        """The recipe and calibration summary of a calibrated checkpoint, else None."""
        return self.manifest.get("quantization")

    def names(self, role: str | None = "model") -> list[str]:
        return [n for n, t in self.tensors.items() if role is None or t.role == role]

    def meta(self, name: str) -> TensorMeta:
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {name!r} in the manifest")
        return self.tensors[name]

    def file(self, name: str) -> SafetensorsFile:
        if name not in self._files:
            self._files[name] = SafetensorsFile(os.path.join(self.path, name))
        return self._files[name]

    def read(self, name: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """Tensor `name` in its stored dtype, or only rows [a, b) of it, reading only their bytes."""
        t = self.meta(name)
        if name not in self._own:
            return self.base.read(name, rows)
        a, b = rows if rows is not None else (0, t.shape[0] if t.shape else 0)
        if rows is not None and not (t.shape and 0 <= a <= b <= t.shape[0]):
            raise CheckpointError(f"{self.path}: rows [{a}, {b}) are outside {name!r} of shape {list(t.shape)}")
        if not t.shape:
            return self._read_part(t, t.parts[0], None)
        pieces = []
        for p in t.parts:
            lo, hi = max(a, p.rows[0]), min(b, p.rows[1])
            if lo < hi or (lo == hi == a and not pieces and a == b):
                pieces.append(self._read_part(t, p, (lo - p.rows[0], hi - p.rows[0])))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def byte_range(self, name: str, row: int | None = None) -> tuple[SafetensorsFile, int, int]:
        """(file, offset, length) of tensor `name` as stored, or of its row `row`: for copying without reading."""
        t = self.meta(name)
        if name not in self._own:
            return self.base.byte_range(name, row)
        if row is None:
            if len(t.parts) != 1:
                raise CheckpointError(f"{self.path}: {name!r} is stored in {len(t.parts)} parts, not one byte range")
            p = t.parts[0]
            f = self.file(p.file)
            return (f, *f.byte_range(p.key))
        p = next((p for p in t.parts if p.rows[0] <= row < p.rows[1]), None)
        if p is None:
            raise CheckpointError(f"{self.path}: row {row} is outside {name!r} of shape {list(t.shape)}")
        f = self.file(p.file)
        return (f, *f.byte_range(p.key, (row - p.rows[0], row - p.rows[0] + 1)))

    def _read_part(self, t: TensorMeta, p: Part, rows) -> torch.Tensor:
        f = self.file(p.file)
        info = f.info(p.key)
        want = (p.rows[1] - p.rows[0], *t.shape[1:]) if t.shape else ()
        if info.dtype != t.dtype or info.shape != want:
            raise CheckpointError(f"{f.path}: {p.key!r} is {info.dtype}{list(info.shape)} but the manifest "
                                  f"says {t.dtype}{list(want)}: the checkpoint is corrupt")
        return f.read(p.key, rows)

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self._files.values()) + (self.base.bytes_read if self.base else 0)

    def hf_files_dir(self) -> str:
        return self.base.hf_files_dir() if self.base else os.path.join(self.path, HF_FILES)

    @property
    def hf_files(self) -> list[str]:
        """The source's non-weight files, relative to `hf_files_dir()`."""
        return self.base.hf_files if self.base else self.manifest["files"]

    def close(self) -> None:
        for f in self._files.values():
            f.close()
        self._files.clear()
        if self.base:
            self.base.close()

    def __enter__(self) -> "Checkpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def manifest_digest(path: str) -> str:
    with open(os.path.join(path, MANIFEST), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def base_reference(out: str, base: str) -> dict:
    """How a checkpoint written at `out` refers to the checkpoint `base` whose tensors it reuses."""
    base = os.path.realpath(base)
    return {"path": os.path.relpath(base, os.path.realpath(out)), "abspath": base, "manifest_sha256": manifest_digest(base)}


def open_base(path: str, ref: dict) -> Checkpoint:
    """The base checkpoint, found beside `path` (as moved together) or where it was, and verified."""
    candidates = [os.path.normpath(os.path.join(path, ref["path"])), ref["abspath"]]
    base = next((c for c in candidates if os.path.isfile(os.path.join(c, MANIFEST))), None)
    if base is None:
        raise CheckpointError(f"{path}: its base checkpoint is gone (looked in {' and '.join(candidates)}); "
                              "it reads its weights from there: restore it, or calibrate again")
    if manifest_digest(base) != ref["manifest_sha256"]:
        raise CheckpointError(f"{path}: its base checkpoint {base} changed since calibration (manifest hash "
                              "differs); calibrate again from the current one")
    return Checkpoint(base)
