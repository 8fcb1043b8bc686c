"""The eprt checkpoint format, version 2.

A directory holding
- `eprt.json`, the manifest: format name and version, family, the normalized config, the
  source config.json verbatim, and a table of every tensor: dtype, shape, encoding, role, and
  where its bytes are (`parts`: file, key in that file, rows [a, b) along dim 0);
- for a tensor the source stores encoded (compressed-tensors, block FP8: eprt.storage.encodings),
  its `encoding` names the format, `scheme` names an entry of the manifest's `schemes` (the
  source's quantization_config group), and `components` are the source tensors it is made of
  (`weight_packed`, `weight_scale`, ...), each stored like a raw tensor with its own parts and,
  for stacked experts, its own rows. `dtype` and `shape` are those of the decoded tensor, which
  `read` returns;
- safetensors files, one per decoder layer plus one for the rest, routed experts stacked
  with the expert index leading, so a reader of rows [a, b) touches only those bytes;
- `hf/`: every non-weight file of the source (config, tokenizer, generation config, ...).

A checkpoint converted by reference (`eprt-convert --reference`) stores none of the weights the
source already holds as eprt reads them: a part whose `file` starts with `source:` lies in the
source directory its manifest names under `source` (path, and a pin of each weight file, as a
calibrated checkpoint pins its base: verified on open). A routed expert's row made of several
source tensors (gate and up) is then one part per source tensor, each marked `piece`, all with
that row's `rows`: the row is their values end to end.

A calibrated checkpoint holds no weights of its own: its manifest names a `base` checkpoint
(path, the SHA-256 of its manifest, and a pin of each of its weight files, verified on open: see
`eprt.storage.pins`) whose tensors it reads, and adds the calibration state (role `calibration`) and the
recipe (`quantization`).

Every file a manifest names must lie inside the checkpoint's directory (eprt.storage.paths).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import threading
from dataclasses import dataclass

import torch

from eprt.config import ModelConfig
from eprt.errors import CheckpointError, ConfigError
from eprt.layout import TensorSpec
from eprt.storage import encodings
from eprt.storage.atomic import atomic_file
from eprt.storage.bounded import read_json_object
from eprt.storage.paths import check_relative, resolve_inside
from eprt.storage.pins import SOURCE, check_weight_pins, open_source, weight_pin, weight_pins
from eprt.storage.safetensors_io import SAFETENSORS_DTYPES, SafetensorsFile, dtype_name

FORMAT = "eprt"
# Version 1 stored the config flat (MLA, MoE and Kimi fields side by side, Kimi's in `extra`);
# an older version is refused by name, with the way out, rather than read.
VERSION = 2
MANIFEST = "eprt.json"
HF_FILES = "hf"


@dataclass(frozen=True)
class Part:
    file: str
    key: str
    rows: tuple[int, int]
    # the file's tensor is one of the source tensors that make up row `rows` (one row) end to end,
    # not rows of the tensor itself
    piece: bool = False


def parts_json(parts: tuple[Part, ...]) -> list[dict]:
    return [{"file": p.file, "key": p.key, "rows": list(p.rows), **({"piece": True} if p.piece else {})} for p in parts]


def parts_from_json(d: list[dict]) -> tuple[Part, ...]:
    return tuple(Part(p["file"], p["key"], tuple(p["rows"]), p.get("piece", False) is True) for p in d)


def row_groups(parts: tuple[Part, ...]) -> list[tuple[tuple[int, int], list[Part]]]:
    """The parts by the rows they hold, in order: one part of whole rows, or a row's pieces."""
    groups: list[tuple[tuple[int, int], list[Part]]] = []
    for p in parts:
        if p.piece and groups and groups[-1][1][-1].piece and groups[-1][0] == p.rows:
            groups[-1][1].append(p)
        else:
            groups.append((p.rows, [p]))
    return groups


@dataclass(frozen=True)
class Component:
    """One source tensor of an encoded tensor, stored as it was (stacked experts: one row per expert,
    each row the expert's `per_row` source tensors end to end)."""

    dtype: torch.dtype
    shape: tuple[int, ...]  # as stored
    source_shape: tuple[int, ...]  # of one source tensor
    parts: tuple[Part, ...]

    def piece(self, row: torch.Tensor, k: int) -> torch.Tensor:
        """The k-th source tensor in one stored row."""
        n = math.prod(self.source_shape)
        return row.reshape(-1)[k * n : (k + 1) * n].reshape(self.source_shape)

    def pieces(self, row: torch.Tensor) -> torch.Tensor:
        """Every source tensor in one stored row, stacked: [per_row, *source_shape]."""
        return row.reshape(-1, *self.source_shape)


@dataclass(frozen=True)
class TensorMeta:
    name: str
    dtype: torch.dtype  # what `read` returns: for an encoded tensor, the decoded dtype
    shape: tuple[int, ...]
    encoding: str  # "raw": the bytes are the tensor; else eprt.storage.encodings names it
    role: str  # "model": the model runs it; "passthrough": carried for export only
    parts: tuple[Part, ...]  # raw only
    source_dtype: torch.dtype  # what the source stored; export writes this dtype back
    scheme: str | None = None  # encoded: the entry of the manifest's `schemes`
    per_row: int | None = None  # encoded stacked experts: source weights per expert row
    components: dict[str, Component] | None = None  # encoded: the source tensors, by local name
    # the Hugging Face name the source held this tensor under, where it is not this one, and under
    # which export writes it back: stacked experts held whole in one tensor of this shape
    # (eprt.layout.TensorSpec.fused), or a tensor the source spells otherwise (TensorSpec.alias)
    fused_source: str | None = None

    @property
    def encoded(self) -> bool:
        return self.encoding != encodings.RAW

    def to_json(self) -> dict:
        d = {
            "dtype": dtype_name(self.dtype),
            "source_dtype": dtype_name(self.source_dtype),
            "shape": list(self.shape),
            "encoding": self.encoding,
            "role": self.role,
            "parts": parts_json(self.parts),
        }
        if self.fused_source is not None:
            d["fused_source"] = self.fused_source
        if self.encoded:
            d["scheme"] = self.scheme
            if self.per_row is not None:
                d["per_row"] = self.per_row
            d["components"] = {
                c: {
                    "dtype": dtype_name(x.dtype),
                    "shape": list(x.shape),
                    "source_shape": list(x.source_shape),
                    "parts": parts_json(x.parts),
                }
                for c, x in self.components.items()
            }
        return d

    @classmethod
    def from_json(cls, name: str, d: dict) -> "TensorMeta":
        components = None
        if "components" in d:
            components = {
                c: Component(
                    SAFETENSORS_DTYPES[x["dtype"]],
                    dims(x["shape"]),
                    dims(x["source_shape"]),
                    parts_from_json(x["parts"]),
                )
                for c, x in d["components"].items()
            }
        return cls(
            name,
            SAFETENSORS_DTYPES[d["dtype"]],
            dims(d["shape"]),
            d["encoding"],
            d["role"],
            parts_from_json(d["parts"]),
            SAFETENSORS_DTYPES[d["source_dtype"]],
            d.get("scheme"),
            d.get("per_row"),
            components,
            d.get("fused_source"),
        )


def stacks_weights(t: TensorMeta, dec) -> bool:
    """Whether encoded `t` is weights stacked along dim 0 (fused experts), each with its own
    components along the same dim or sharing a scalar one: its rows then decode from those rows of
    its components (and the scalars) alone."""
    return (
        getattr(dec, "batched", False)
        and len(t.shape) == 3
        and all(not x.shape or x.shape[0] == t.shape[0] for x in t.components.values())
    )


def dims(shape: list) -> tuple[int, ...]:
    """A manifest's shape: a list of sizes, each a non-negative integer (ValueError otherwise: a
    crafted size would otherwise be allocated by)."""
    if not isinstance(shape, list) or not all(type(n) is int and n >= 0 for n in shape):
        raise ValueError(f"shape {shape!r:.80} is not a list of sizes")
    return tuple(shape)


def manifest(
    family: str, config: ModelConfig, source_config: dict, tensors: list[TensorMeta], files: list[str], **extra
) -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "family": family,
        "config": config.to_json(),
        "source_config": source_config,
        "tensors": {t.name: t.to_json() for t in tensors},
        "files": files,
        **extra,
    }


def write_manifest(directory: str, m: dict) -> None:
    with atomic_file(os.path.join(directory, MANIFEST)) as f:
        json.dump(m, f, indent=1)


class Checkpoint:
    """Read access to an eprt checkpoint: any tensor, or any rows of it, straight from disk."""

    def __init__(self, path: str):
        self.path = path
        mpath = os.path.join(path, MANIFEST)
        if not os.path.isfile(mpath):
            raise CheckpointError(
                f"{path}: no {MANIFEST}; not an eprt checkpoint (convert one with tools/convert_hf.py)"
            )
        m = read_json_object(mpath, "the manifest is corrupt: convert the checkpoint again", CheckpointError)
        older = m.get("version") if m.get("format") == FORMAT else None
        if type(older) is int and 0 < older < VERSION:
            raise CheckpointError(
                f"{mpath}: format version {older}, written by an older eprt; this eprt reads "
                f"version {VERSION}, whose config it holds typed: convert the source again "
                "(tools/convert_hf.py), and calibrate again from that"
            )
        if m.get("format") != FORMAT or m.get("version") != VERSION:
            raise CheckpointError(
                f"{mpath}: format {m.get('format')!r} version {m.get('version')!r}; "
                f"this eprt reads {FORMAT!r} version {VERSION}"
            )
        self.manifest = m
        try:
            self.config = ModelConfig.from_json(m.get("config"), "config")
        except ConfigError as e:
            raise CheckpointError(f"{mpath}: corrupt manifest: {e}; convert the checkpoint again") from None
        try:
            self.family: str = m["family"]
            self.source_config: dict = m["source_config"]
            own = {n: TensorMeta.from_json(n, d) for n, d in m["tensors"].items()}
            for rel in m["files"]:
                check_relative(rel, f"{mpath} (files)")
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(
                f"{mpath}: corrupt manifest ({type(e).__name__}: {e}); convert the checkpoint again"
            ) from None
        self.schemes: dict[str, dict] = m.get("schemes", {})
        for t in own.values():
            if not encodings.is_known(t.encoding):
                raise CheckpointError(
                    f"{mpath}: {t.name!r} has encoding {t.encoding!r}, which this eprt does not "
                    f"read ({', '.join(encodings.known())}): the checkpoint is corrupt, "
                    "crafted, or written by a newer eprt"
                )
            for f in stored_files(t):
                check_relative(f.removeprefix(SOURCE), f"{mpath} ({t.name!r})")
            if t.encoded and t.scheme not in self.schemes:
                raise CheckpointError(
                    f"{mpath}: {t.name!r} names scheme {t.scheme!r}, which the manifest lacks: "
                    "the checkpoint is corrupt"
                )
        self._own = set(own)
        referenced = sorted({f for t in own.values() for f in stored_files(t) if f.startswith(SOURCE)})
        self.source_dir = open_source(path, mpath, m.get("source"), referenced) if referenced else None
        self.base = open_base(path, m["base"]) if "base" in m else None
        self.tensors = {**(self.base.tensors if self.base else {}), **own}
        self._files: dict[str, SafetensorsFile] = {}
        self._decoders: dict[tuple[str, str], object] = {}
        # threads may read side by side (the export's CPU workers): files and decoders open once
        self._opening = threading.Lock()
        # each own weight file's pin, taken as it was opened for reading: what a run computed from
        self.read_pins: dict[str, dict] = {}

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
        with self._opening:
            if name not in self._files:
                f = SafetensorsFile(self.file_path(name))
                self.read_pins[name] = weight_pin(f.path)
                self._files[name] = f
            return self._files[name]

    def file_path(self, name: str) -> str:
        """Where weight file `name` of the manifest lies: in this directory, or in the source's (`SOURCE`)."""
        where = os.path.join(self.path, MANIFEST)
        if name.startswith(SOURCE):
            return resolve_inside(self.source_dir, name.removeprefix(SOURCE), where)
        return resolve_inside(self.path, name, where)

    def weight_files(self) -> list[str]:
        """The files this checkpoint's own tensors are stored in (not its base's), as the manifest
        names them (`SOURCE` and a name in the source directory, for one it references), sorted."""
        return sorted({f for n in self._own for f in stored_files(self.tensors[n])})

    def input_dirs(self) -> tuple[str, ...]:
        """Every directory reading this checkpoint reads: its own, the source's it references, its base's."""
        source = (self.source_dir,) if self.source_dir else ()
        return (self.path, *source, *(self.base.input_dirs() if self.base else ()))

    def read(self, name: str, rows: tuple[int, int] | None = None, device=None) -> torch.Tensor:
        """Tensor `name`, or only rows [a, b) of it, reading only their bytes: a raw tensor in its
        stored dtype, an encoded one decoded (to `meta(name).dtype`) one stored row at a time. With
        `device`, an encoding whose decoder computes anywhere (block FP8) is decoded there: its stored
        bytes, a quarter to a half of the decoded ones, are what is copied to it; a raw tensor, or one
        whose decoder runs on the CPU, is returned on the CPU as ever."""
        t = self.meta(name)
        if name not in self._own:
            return self.base.read(name, rows, device)
        a, b = self._rows(t, rows)
        if t.encoded:
            return self._decode(t, a, b, rows is not None, device)
        if not t.shape:
            return self._read_part(t.dtype, t.shape, t.parts[0], None)
        return self._read_parts(t.dtype, t.shape, t.parts, a, b)

    def read_expert(self, spec: TensorSpec, e: int) -> torch.Tensor:
        """Expert e's row of stacked `spec`: from the stacked tensor, or, where convert carried the
        layer through under its Hugging Face names (a multi-token-prediction layer, `Layout.mtp`),
        from the expert's source tensors end to end, as the stacked row holds them."""
        if spec.name in self.tensors:
            return self.read(spec.name, rows=(e, e + 1))[0]
        return torch.cat([self.read(s) for s in spec.sources[e * spec.per_row : (e + 1) * spec.per_row]])

    def read_component(self, name: str, component: str, rows: tuple[int, int] | None = None) -> torch.Tensor:
        """One stored source tensor of encoded tensor `name` as it lies on disk (or rows [a, b) of it)."""
        t = self.meta(name)
        if name not in self._own:
            return self.base.read_component(name, component, rows)
        c = self._component(t, component)
        if not c.shape:
            return self._read_part(c.dtype, c.shape, c.parts[0], None)
        a, b = rows if rows is not None else (0, c.shape[0])
        return self._read_parts(c.dtype, c.shape, c.parts, a, b)

    def _rows(self, t: TensorMeta, rows) -> tuple[int, int]:
        a, b = rows if rows is not None else (0, t.shape[0] if t.shape else 0)
        if rows is not None and not (t.shape and 0 <= a <= b <= t.shape[0]):
            raise CheckpointError(f"{self.path}: rows [{a}, {b}) are outside {t.name!r} of shape {list(t.shape)}")
        return a, b

    def _component(self, t: TensorMeta, component: str) -> Component:
        if not t.encoded or component not in t.components:
            have = list(t.components) if t.encoded else []
            raise CheckpointError(f"{self.path}: {t.name!r} has no stored component {component!r} (it has {have})")
        return t.components[component]

    def _read_parts(
        self, dtype: torch.dtype, shape: tuple[int, ...], parts: tuple[Part, ...], a: int, b: int
    ) -> torch.Tensor:
        pieces = []
        for rows, group in row_groups(parts):
            lo, hi = max(a, rows[0]), min(b, rows[1])
            if group[0].piece and lo < hi:
                pieces.append(self._read_row(dtype, shape, group))
            elif lo < hi or (lo == hi == a and not pieces and a == b):
                pieces.append(self._read_part(dtype, shape, group[0], (lo - rows[0], hi - rows[0])))
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)

    def _read_row(self, dtype: torch.dtype, shape: tuple[int, ...], pieces: list[Part]) -> torch.Tensor:
        """One row made of source tensors end to end (`Part.piece`), as [1, *shape[1:]]."""
        row = math.prod(shape[1:])
        values = []
        for p in pieces:
            f = self.file(p.file)
            info = f.info(p.key)
            if p.rows[1] - p.rows[0] != 1 or info.dtype != dtype or math.prod(info.shape) * len(pieces) != row:
                raise CheckpointError(
                    f"{f.path}: {p.key!r} is {info.dtype}{list(info.shape)}, which is not one of "
                    f"{len(pieces)} equal pieces of a {dtype}{list(shape[1:])} row {list(p.rows)} as the "
                    "manifest says: the checkpoint is corrupt, or its source changed"
                )
            values.append(f.read(p.key).reshape(-1))
        return torch.cat(values).reshape(1, *shape[1:])

    # --- encoded tensors ----------------------------------------------------------------------
    def decoder(self, name: str):
        """The decoder of encoded tensor `name` (importing compressed-tensors where it needs it)."""
        t = self.meta(name)
        if name not in self._own:
            return self.base.decoder(name)
        with self._opening:
            kind = (t.encoding, t.scheme)  # one scheme may hold several encodings (DeepSeek-V4's FP8 and FP4)
            if kind not in self._decoders:
                self._decoders[kind] = encodings.decoder(t.encoding, self.schemes[t.scheme], f"{self.path} ({name})")
            return self._decoders[kind]

    def _decode(self, t: TensorMeta, a: int, b: int, sliced: bool, device=None) -> torch.Tensor:
        dec = self.decoder(t.name)
        device = torch.device(device) if device is not None and getattr(dec, "on_device", False) else None
        if t.per_row is None and sliced and stacks_weights(t, dec):  # rows [a, b) of fused experts, read alone
            stored = {c: self.read_component(t.name, c, (a, b)).to(device) for c in t.components}
            return self._decoded(t, dec, stored, (b - a, *t.shape[1:]))
        if t.per_row is None:  # one weight, decoded whole
            stored = {c: self.read_component(t.name, c).to(device) for c in t.components}
            w = self._decoded(t, dec, stored, t.shape)
            return w[a:b] if sliced else w
        # Stacked experts: an expert row holds per_row source weights end to end, each decoded alone
        # into its place (a batched decoder takes the row's at once); memory holds the rows' stored
        # bytes, one row's on the device, and their decoded result, nothing more.
        stored = {c: self.read_component(t.name, c, (a, b)) for c in t.components}
        out = torch.empty((b - a, *t.shape[1:]), dtype=t.dtype, device=device)
        h = t.shape[1] // t.per_row
        for i in range(b - a):
            if getattr(dec, "batched", False):
                local = {c: t.components[c].pieces(v[i]).to(device) for c, v in stored.items()}
                out[i] = self._decoded(t, dec, local, (t.per_row, h, *t.shape[2:])).view(t.shape[1:])
                continue
            for k in range(t.per_row):
                local = {c: t.components[c].piece(v[i], k) for c, v in stored.items()}
                out[i, k * h : (k + 1) * h] = self._decoded(t, dec, local, (h, *t.shape[2:]))
        return out

    def _decoded(self, t: TensorMeta, dec, local: dict[str, torch.Tensor], shape: tuple[int, ...]) -> torch.Tensor:
        w = dec.decode(local)
        if w.dtype != t.dtype or tuple(w.shape) != tuple(shape):
            raise CheckpointError(
                f"{self.path}: {t.name!r} ({t.encoding}) decodes to {w.dtype}{list(w.shape)} but the "
                f"manifest says {t.dtype}{list(shape)}: it was converted with another decoder; "
                "convert it again"
            )
        return w

    def check_decode(self, dtype: torch.dtype | None = None, role: str | None = "model") -> None:
        """Refuse, before any weight is read, encoded tensors (of `role`) that cannot be decoded
        here, or whose decoded values loading in `dtype` would round again."""
        for name in self.names(role):
            t = self.tensors[name]
            if not t.encoded:
                continue
            self.decoder(name)
            if dtype is not None and not encodings.decoded_dtype_ok(t.dtype, dtype):
                raise ConfigError(
                    f"{self.path}: {name} is stored {t.encoding} and decompresses to {t.dtype}; "
                    f"loading it as {dtype} would round every weight again: load with "
                    f"dtype={t.dtype} or torch.float32"
                )

    def byte_range(
        self, name: str, row: int | None = None, component: str | None = None
    ) -> tuple[SafetensorsFile, int, int]:
        """(file, offset, length) of tensor `name` as stored (of its stored `component`, for an
        encoded one), or of its row `row`: for copying without reading."""
        t = self.meta(name)
        if name not in self._own:
            return self.base.byte_range(name, row, component)
        shape, parts = (
            (t.shape, t.parts)
            if component is None
            else (self._component(t, component).shape, t.components[component].parts)
        )
        if row is None:
            if len(parts) != 1:
                raise CheckpointError(f"{self.path}: {name!r} is stored in {len(parts)} parts, not one byte range")
            p = parts[0]
            f = self.file(p.file)
            return (f, *f.byte_range(p.key))
        p = next((p for p in parts if p.rows[0] <= row < p.rows[1]), None)
        if p is None:
            raise CheckpointError(f"{self.path}: row {row} is outside {name!r} of shape {list(shape)}")
        if p.piece:
            raise CheckpointError(f"{self.path}: row {row} of {name!r} is stored in pieces, not one byte range")
        f = self.file(p.file)
        return (f, *f.byte_range(p.key, (row - p.rows[0], row - p.rows[0] + 1)))

    def piece_range(
        self, name: str, row: int, k: int, per_row: int, component: str | None = None
    ) -> tuple[SafetensorsFile, int, int]:
        """(file, offset, length) of the k-th of the `per_row` equal source tensors row `row` of
        stacked `name` holds end to end (of its stored `component`, for an encoded one)."""
        t = self.meta(name)
        if name not in self._own:
            return self.base.piece_range(name, row, k, per_row, component)
        parts = t.parts if component is None else self._component(t, component).parts
        pieces = next((g for rows, g in row_groups(parts) if g[0].piece and rows[0] == row), None)
        if pieces is not None:
            if len(pieces) != per_row:
                raise CheckpointError(
                    f"{self.path}: row {row} of {name!r} is stored in {len(pieces)} pieces, not {per_row}: "
                    "the checkpoint is corrupt"
                )
            f = self.file(pieces[k].file)
            return (f, *f.byte_range(pieces[k].key))
        f, offset, n = self.byte_range(name, row, component)
        return f, offset + k * (n // per_row), n // per_row

    def _read_part(self, dtype: torch.dtype, shape: tuple[int, ...], p: Part, rows) -> torch.Tensor:
        f = self.file(p.file)
        info = f.info(p.key)
        want = (p.rows[1] - p.rows[0], *shape[1:]) if shape else ()
        if info.dtype != dtype or info.shape != want:
            raise CheckpointError(
                f"{f.path}: {p.key!r} is {info.dtype}{list(info.shape)} but the manifest "
                f"says {dtype}{list(want)}: the checkpoint is corrupt"
            )
        return f.read(p.key, rows)

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self._files.values()) + (self.base.bytes_read if self.base else 0)

    def hf_files_dir(self) -> str:
        if self.base:
            return self.base.hf_files_dir()
        return resolve_inside(self.path, HF_FILES, os.path.join(self.path, MANIFEST))

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


def stored_files(t: TensorMeta) -> set[str]:
    parts = list(t.parts) + [p for c in (t.components or {}).values() for p in c.parts]
    return {p.file for p in parts}


def manifest_digest(path: str) -> str:
    with open(os.path.join(path, MANIFEST), "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def base_reference(out: str, base: str) -> dict:
    """How a checkpoint written at `out` refers to the checkpoint `base` whose tensors it reuses."""
    base = os.path.realpath(base)
    with Checkpoint(base) as ck:
        pins = weight_pins(ck)
    return {
        "path": os.path.relpath(base, os.path.realpath(out)),
        "abspath": base,
        "manifest_sha256": manifest_digest(base),
        "weights": pins,
    }


def open_base(path: str, ref: dict) -> Checkpoint:
    """The base checkpoint, found beside `path` (as moved together) or where it was, and verified."""
    candidates = [os.path.normpath(os.path.join(path, ref["path"])), ref["abspath"]]
    base = next((c for c in candidates if os.path.isfile(os.path.join(c, MANIFEST))), None)
    if base is None:
        raise CheckpointError(
            f"{path}: its base checkpoint is gone (looked in {' and '.join(candidates)}); "
            "it reads its weights from there: restore it, or calibrate again"
        )
    if manifest_digest(base) != ref["manifest_sha256"]:
        raise CheckpointError(
            f"{path}: its base checkpoint {base} changed since calibration (manifest hash "
            "differs); calibrate again from the current one"
        )
    if not isinstance(ref.get("weights"), dict) or not ref["weights"]:
        raise CheckpointError(
            f"{path}: it does not pin its base's weight files (calibrated by an older eprt), so "
            f"a change of {base} could not be seen; calibrate again"
        )
    ck = Checkpoint(base)
    try:
        check_weight_pins(path, ck, ref["weights"])
    except BaseException:
        ck.close()
        raise
    return ck
