"""Hugging Face safetensors -> eprt checkpoint, streamed one tensor at a time.

Every check (config, headers, names, shapes, dtypes, encodings) runs before the first byte is
written; then each output file is filled tensor by tensor. A stacked expert tensor [E, 2I, H] is
the per-expert gate and up tensors laid end to end, so it is written by copying each source
tensor in turn: memory holds one source tensor, never a layer. A source that holds a layer's
experts already stacked (`experts.gate_up_proj`, eprt.layout.TensorSpec.fused) is copied as one
tensor, and the manifest names it so that export writes it back whole.

Weights the source stores encoded (compressed-tensors, block FP8: eprt.storage.encodings) stay
encoded: each of their source tensors (packed values, scales, ...) is stacked the same way as a
component of the eprt tensor, and the manifest records the scheme. Nothing is decompressed on
disk; `Checkpoint.read` decodes.

With `reference`, nothing the source holds as eprt reads it is copied: the manifest names the
source's own files (`eprt.storage.pins.SOURCE`, pinned as a calibrated checkpoint pins its
base), so conversion costs what reading the headers costs. Stacked experts need no restacking
on disk either: an expert's row is the parts that hold its source tensors (gate, then up) end
to end (`Part.piece`), each read in place. Only a tensor `--dtype` casts is written; a tensor
read in place is not scanned for NaN here (a NaN weight still stops calibration at its amax).
"""

from __future__ import annotations

import math
import os
import shutil
from collections import defaultdict
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from eprt.errors import CheckpointError, ConfigError
from eprt.families import load_hf_config, reader_for
from eprt.hf.source import HFSource, non_weight_files
from eprt.hf.source_encoded import Encoded, encoded_modules, source_module
from eprt.layout import Layout, TensorSpec, layer_of, plain
from eprt.progress import bar, logger
from eprt.storage import encodings
from eprt.storage.atomic import atomic_output_dir, copy_files
from eprt.storage.checkpoint import (
    HF_FILES,
    Component,
    Part,
    TensorMeta,
    manifest,
    stored_files,
    write_manifest,
)
from eprt.storage.hf_files import CHAT_TEMPLATE, CONFIG
from eprt.storage.pins import SOURCE, source_reference
from eprt.storage.safetensors_io import SafetensorsWriter

DTYPE_CHOICES = {"keep": None, "bf16": torch.bfloat16, "fp32": torch.float32}
_CASTABLE = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass(frozen=True)
class Planned:
    spec: TensorSpec
    source_dtype: torch.dtype
    dtype: torch.dtype
    role: str
    encoded: tuple[Encoded, ...] = ()  # an encoded tensor: one per source of `spec`
    # an encoded tensor: each component's dtype and shape in one source
    components: dict[str, tuple[torch.dtype, tuple[int, ...]]] = field(default_factory=dict)
    fused: bool = False  # stacked experts read whole from the one source tensor in spec.sources

    def stored(self) -> list[tuple[str, torch.dtype, tuple[int, ...]]]:
        """(key in the file, dtype, shape) of each tensor written for it."""
        if not self.encoded:
            return [(self.spec.name, self.dtype, self.spec.shape)]
        return [
            (component_key(self.spec.name, c), dt, stored_shape(self.spec, shape))
            for c, (dt, shape) in self.components.items()
        ]


def component_key(name: str, component: str) -> str:
    return f"{name}.{component}"


def stored_shape(spec: TensorSpec, shape: tuple[int, ...]) -> tuple[int, ...]:
    """A component stacked like its tensor: expert row e holds the expert's per_row sources end to end."""
    if not spec.stacked:
        return shape
    return (spec.shape[0], spec.per_row * (shape[0] if shape else 1), *shape[1:])


def describe(e: Encoded | None) -> str:
    return "stored unencoded" if e is None else f"{e.encoding} (scheme {e.scheme})"


def file_for(name: str, role: str) -> str:
    layer = layer_of(name)
    prefix = "passthrough" if role == "passthrough" else "layer"
    if layer is None:
        return "passthrough.safetensors" if role == "passthrough" else "model.safetensors"
    return f"{prefix}-{layer:05d}.safetensors"


def as_source_holds(src: HFSource, encoded: dict[str, Encoded], spec: TensorSpec) -> tuple[TensorSpec, bool]:
    """`spec` as the source stores it, and whether that is fused: stacked experts the source holds
    whole in `spec.fused` become one plain tensor of the stacked shape, read from there. Stored
    encoded, its components hold each weight's outputs along dim 1 whatever the raw form's
    orientation: the tensor is then not transposed, though still interleaved where it is."""
    if spec.fused is None or (spec.fused not in src.tensors and spec.fused not in encoded):
        return spec, False
    fused = spec.as_fused() if spec.fused not in encoded else replace(spec.as_fused(), transposed=False)
    again = [s for s in spec.sources if s in src.tensors]
    if again:
        held = next(iter(encoded[spec.fused].components.values())) if spec.fused in encoded else spec.fused
        f, _ = src.tensors[held]
        raise CheckpointError(
            f"{f.path}: tensor {spec.fused!r} holds every expert of {spec.name.rsplit('.', 1)[0]}, "
            f"but {again[0]!r} holds one of them again; keep one of the two forms"
        )
    return fused, True


def as_source_spells(src: HFSource, encoded: dict[str, Encoded], spec: TensorSpec, where: str) -> TensorSpec:
    """`spec` read from its other spelling (`spec.alias`) where the source holds it under that name,
    plain or encoded."""

    def held(name: str) -> bool:
        return name in src.tensors or source_module(name) in encoded

    if spec.alias is None or not held(spec.alias):
        return spec
    if held(spec.sources[0]):
        raise CheckpointError(
            f"{where}: {spec.sources[0]!r} and {spec.alias!r} are one tensor under its two "
            "spellings, and the checkpoint holds both; keep one of them"
        )
    return replace(spec, sources=(spec.alias,))


class ConversionPlanner:
    """Checks the source against the layout and decides every output tensor's dtype and encoding."""

    def __init__(
        self,
        src: HFSource,
        layout: Layout,
        dtype: torch.dtype | None,
        where: str,
        quant: encodings.SourceQuantization | None,
    ):
        self.src, self.layout, self.dtype, self.where, self.quant = src, layout, dtype, where, quant
        self.encoded = encoded_modules(src, quant)
        self.decoders: dict[tuple[str, str], object] = {}
        self.probed: dict[tuple, tuple[torch.dtype, tuple[int, ...]]] = {}

    def schemes(self, planned: list[Planned]) -> dict[str, dict]:
        """The manifest's `schemes`: each one an encoded tensor names."""
        used = {e.scheme for p in planned for e in p.encoded}
        if used and self.quant.method != encodings.CT:  # one scheme: the whole quantization_config
            return {self.quant.method: self.quant.config}
        groups = self.quant.groups() if used else {}
        return {g: groups[g] for g in sorted(used)}

    def scheme(self, e: Encoded) -> dict:
        return self.quant.groups()[e.scheme] if self.quant.method == encodings.CT else self.quant.config

    def plan(self) -> list[Planned]:
        """Every output tensor; refuses on any mismatch."""
        src = self.src
        planned, claimed = [], set()
        for spec in self.layout.specs:
            spec, fused = as_source_holds(src, self.encoded, as_source_spells(src, self.encoded, spec, self.where))
            if fused and spec.fused in self.encoded:  # fused experts stored encoded (per-tensor FP8, MXFP4)
                e = self.encoded[spec.fused]
                planned.append(replace(self.plan_encoded(spec, [e], "model"), fused=True))
                claimed.update(e.components.values())
                continue
            if fused:
                planned.append(replace(self.plan_raw(spec), fused=True))
                claimed.add(spec.fused)
                continue
            encs = [self.encoded.get(source_module(s)) for s in spec.sources]
            if any(encs):
                planned.append(self.plan_encoded(spec, encs, "model"))
                claimed.update(n for e in encs for n in e.components.values())
                continue
            planned.append(self.plan_raw(spec))
            claimed.update(spec.sources)
        unread = []
        owner = {n: m for m, e in self.encoded.items() for n in e.components.values()}
        done = set()
        for name, (f, info) in src.tensors.items():
            if name in claimed:
                continue
            if not self.layout.is_passthrough(name):
                unread.append((f.path, name))
            elif name in owner:
                module = owner[name]
                if module not in done:
                    done.add(module)
                    e = self.encoded[module]
                    _, shape = self.probe(e)
                    planned.append(self.plan_encoded(plain(e.weight, *shape), [e], "passthrough"))
            else:
                self.refuse_unscaled_fp8(name)
                planned.append(
                    Planned(
                        plain(name, *info.shape), info.dtype, out_dtype(info.dtype, self.dtype, False), "passthrough"
                    )
                )
        if unread:
            path, name = unread[0]
            more = f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""
            raise CheckpointError(
                f"{path}: tensor {name!r}{more}: nothing in the model reads it; the checkpoint "
                f"does not match its config.json (wrong num_hidden_layers, experts or layer types?)"
            )
        return planned

    def plan_raw(self, spec: TensorSpec) -> Planned:
        src, where = self.src, self.where
        missing = [s for s in spec.sources if s not in src.tensors]
        if missing:
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            fused = (
                f", nor is {spec.fused!r}, which may hold them all"
                if spec.fused
                else f", nor is its other spelling {spec.alias!r}"
                if spec.alias
                else ""
            )
            raise CheckpointError(
                f"{where}: tensor {missing[0]!r}{more} is missing{fused}; config.json says the model has it"
            )
        dtypes = set()
        for s in spec.sources:
            f, info = src.tensors[s]
            problem = spec.shape_problem(info.shape)
            if problem:
                raise CheckpointError(f"{f.path}: tensor {s!r} {problem}")
            self.refuse_unscaled_fp8(s)
            if not info.dtype.is_floating_point and not spec.table:
                raise CheckpointError(
                    f"{f.path}: tensor {s!r} is {info.dtype}, but it is a weight of the model, "
                    "which is floating point: the file is not this model's checkpoint"
                )
            dtypes.add(info.dtype)
        if spec.padded_per:
            spec = spec.stored_as(info.shape)
        if len(dtypes) > 1:
            raise CheckpointError(
                f"{where}: the tensors stacked into {spec.name!r} have different dtypes "
                f"{sorted(map(str, dtypes))}; convert with --dtype bf16 or fp32"
            )
        (sdt,) = dtypes
        return Planned(spec, sdt, out_dtype(sdt, self.dtype, self.layout.is_precise(spec.name)), "model")

    def refuse_unscaled_fp8(self, name: str) -> None:
        f, info = self.src.tensors[name]
        if info.dtype in _FP8:
            raise CheckpointError(
                f"{f.path}: tensor {name!r} is {info.dtype} without a scale (weight_scale_inv) "
                "beside it: unscaled FP8 would load unscaled; eprt reads FP8 with its scales only: "
                "dequantize the checkpoint to bf16 first"
            )

    def plan_encoded(self, spec: TensorSpec, encs: list[Encoded | None], role: str) -> Planned:
        """An encoded tensor: every source of `spec` stored alike, one scheme, decoding to its shape."""
        j = next(j for j, e in enumerate(encs) if e is not None)
        first, src0 = encs[j], spec.sources[j]
        for s, e in zip(spec.sources, encs):
            if e is None or (e.encoding, e.scheme) != (first.encoding, first.scheme):
                raise CheckpointError(
                    f"{self.where}: the weights stacked into {spec.name!r} disagree: {s!r} is "
                    f"{describe(e)} but {src0!r} is {describe(first)}; eprt stacks one scheme per "
                    "tensor: store every expert of a layer alike"
                )
        components = {}
        for c in first.components:
            for e in encs:
                f, info = self.src.tensors[e.components[c]]
                if c not in components:
                    components[c] = (info.dtype, info.shape)
                elif components[c] != (info.dtype, info.shape):
                    dt, shape = components[c]
                    raise CheckpointError(
                        f"{f.path}: tensor {e.components[c]!r} is {info.dtype}{list(info.shape)} but "
                        f"{first.components[c]!r} is {dt}{list(shape)}: the weights stacked into "
                        f"{spec.name!r} disagree on their scheme; store every expert of a layer alike"
                    )
        dtype, shape = self.probe(first)
        if shape != spec.source_shape():
            raise CheckpointError(
                f"{self.where}: {source_module(src0)} ({first.encoding}) decodes to shape "
                f"{list(shape)} but config.json implies {list(spec.source_shape())}"
            )
        return Planned(spec, dtype, dtype, role, tuple(encs), components)

    def probe(self, e: Encoded) -> tuple[torch.dtype, tuple[int, ...]]:
        """(dtype, shape) one weight decodes to, found by decoding it: once per scheme and stored shapes."""
        infos = {c: self.src.tensors[n] for c, n in e.components.items()}
        key = (e.encoding, e.scheme, tuple((c, i.dtype, i.shape) for c, (_, i) in infos.items()))
        if key not in self.probed:
            kind = (e.encoding, e.scheme)  # one scheme may hold several encodings (DeepSeek-V4's FP8 and FP4)
            if kind not in self.decoders:
                self.decoders[kind] = encodings.decoder(e.encoding, self.scheme(e), self.quant.where)
            try:
                w = self.decoders[kind].decode({c: f.read(e.components[c]) for c, (f, _) in infos.items()})
            except (ValueError, RuntimeError, IndexError, KeyError, CheckpointError) as err:
                module = next(iter(e.components.values())).rpartition(".")[0]
                raise CheckpointError(
                    f"{self.where}: {module} ({e.encoding}, scheme {e.scheme}) does not decode: {err}"
                ) from None
            self.probed[key] = (w.dtype, tuple(w.shape))
        return self.probed[key]


def out_dtype(source: torch.dtype, want: torch.dtype | None, precise: bool) -> torch.dtype:
    return want if want is not None and source in _CASTABLE and not precise else source


def convert_hf(
    hf_dir: str,
    out_dir: str,
    *,
    dtype: str = "keep",
    overwrite: bool = False,
    progress: bool = True,
    reference: bool = False,
    chat_template: str | None = None,
) -> str:
    """Convert a Hugging Face directory into an eprt checkpoint at `out_dir`; returns its path.
    With `reference`, the checkpoint reads in place every source tensor it keeps as it is. With
    `chat_template` (a Jinja file), the checkpoint's chat template is that file's, whatever the
    source's: calibration renders conversations with it, and a quantized export carries it."""
    if dtype not in DTYPE_CHOICES:
        raise ConfigError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPE_CHOICES)}")
    if not os.path.isdir(hf_dir):
        raise ConfigError(f"{hf_dir}: not a directory")
    hf_cfg, cfg = load_hf_config(hf_dir)
    layout = reader_for(cfg.model_type, hf_dir).layout(cfg)
    quant = encodings.source_quantization(hf_cfg, os.path.join(hf_dir, CONFIG))
    src = HFSource(hf_dir)
    try:
        planner = ConversionPlanner(src, layout, DTYPE_CHOICES[dtype], hf_dir, quant)
        planned = planner.plan()
        schemes = planner.schemes(planned)
        by_file: dict[str, list[Planned]] = defaultdict(list)
        for p in planned:
            by_file[file_for(p.spec.name, p.role)].append(p)
        with atomic_output_dir(out_dir, overwrite=overwrite, inputs=(hf_dir,)) as tmp:
            metas = write_files(src, by_file, tmp, progress, reference)
            files = copy_hf_files(hf_dir, tmp, chat_template)
            extra = {"schemes": schemes} if schemes else {}
            read_in_place = sorted(
                {f.removeprefix(SOURCE) for m in metas for f in stored_files(m) if f.startswith(SOURCE)}
            )
            if read_in_place:
                extra["source"] = source_reference(out_dir, hf_dir, read_in_place)
            write_manifest(
                tmp, manifest(cfg.family, cfg, hf_cfg, metas, files, converted_with={"dtype": dtype}, **extra)
            )
    finally:
        src.close()
    logger().info("converted %s -> %s (%d tensors)", hf_dir, out_dir, len(planned))
    return out_dir


def write_files(
    src: HFSource, by_file: dict[str, list[Planned]], tmp: str, progress: bool, reference: bool = False
) -> list[TensorMeta]:
    """Each file's tensors written in turn (with `reference`, only those the source does not hold as
    they are): their manifest entries, in the order of `by_file`."""
    metas = []
    copied = {f: [p for p in ps if not (reference and in_place(src, p))] for f, ps in by_file.items()}
    written = {id(p) for ps in copied.values() for p in ps}
    total = sum(dt.itemsize * math.prod(shape) for ps in copied.values() for p in ps for _, dt, shape in p.stored())
    with bar(total, "convert", unit="B", enabled=progress and total > 0) as pb:
        for fname, ps in by_file.items():
            path = os.path.join(tmp, fname)
            try:
                w = (
                    SafetensorsWriter(path, [entry for p in copied[fname] for entry in p.stored()])
                    if copied[fname]
                    else None
                )
                for p in ps:
                    if id(p) not in written:
                        metas.append(referenced(src, p))
                    else:
                        metas.append(
                            write_encoded(src, w, fname, p, pb) if p.encoded else write_raw(src, w, fname, p, pb)
                        )
                if w is not None:
                    w.close()
            except OSError as e:
                if e.filename is not None:
                    raise
                # a failed write says only why (disk full); the file it was writing is the way in
                raise OSError(e.errno, e.strerror, path) from e
    return metas


# The exponent bits of each floating dtype, as an integer of its width: all set in NaN and infinity only.
EXPONENT_BITS = {
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
    torch.float32: (torch.int32, 0x7F800000),
    torch.float64: (torch.int64, 0x7FF0000000000000),
}


def holds_non_finite(t: torch.Tensor) -> bool:
    """Whether `t` holds a NaN or an infinity. One pass over the bits in numpy (single-threaded,
    vectorized): torch's parallel reductions stall when the cores are busy, and this check must
    stay cheap next to a copy."""
    if t.dtype not in EXPONENT_BITS or not t.numel():
        return False
    int_dtype, exponent = EXPONENT_BITS[t.dtype]
    return int(np.bitwise_and(t.reshape(-1).view(int_dtype).numpy(), exponent).max()) == exponent


def refuse_non_finite(path: str, name: str, t: torch.Tensor) -> None:
    """A NaN or infinity in a weight passes every later step until a scale of it is NaN: refuse it here."""
    if holds_non_finite(t):
        raise CheckpointError(
            f"{path}: tensor {name!r} holds NaN or infinite values; a checkpoint with broken "
            "weights cannot be calibrated: fix or re-download the source"
        )


def cast_finite(path: str, name: str, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` (finite) cast to `dtype`, refused where a value lies beyond `dtype`'s range: the cast
    rounds it to infinity, which convert would otherwise write as if it were the weight."""
    cast = t.to(dtype)
    if holds_non_finite(cast):
        choice = next(k for k, v in DTYPE_CHOICES.items() if v == dtype)
        ways = [
            f"--dtype {k}"
            for k, v in DTYPE_CHOICES.items()
            if v != dtype and (v is None or torch.finfo(v).max >= torch.finfo(dtype).max)
        ]
        raise CheckpointError(
            f"{path}: tensor {name!r} holds values up to {t.abs().max().item():.6g} in magnitude, "
            f"beyond {choice}'s largest ({torch.finfo(dtype).max:.6g}): --dtype {choice} would "
            f"write them as infinity; convert with {' or '.join(ways)}"
        )
    return cast


def write_raw(src: HFSource, w: SafetensorsWriter, fname: str, p: Planned, pb) -> TensorMeta:
    for s in p.spec.sources:
        f, info = src.tensors[s]
        t = f.read(s)
        refuse_non_finite(f.path, s, t)
        if p.fused and p.spec.permuted:  # fused experts stored transposed or interleaved: in eprt's order
            w.write(p.spec.name, cast_finite(f.path, s, p.spec.from_fused(t), p.dtype).contiguous())
        elif info.dtype == p.dtype:
            w.copy_range(p.spec.name, f, info.start, info.nbytes)  # from the page cache the read just filled
        else:
            w.write(p.spec.name, cast_finite(f.path, s, t, p.dtype))
        pb.update(p.dtype.itemsize * math.prod(info.shape))
    rows = (0, p.spec.shape[0] if p.spec.shape else 0)
    return meta_of(p, parts=(Part(fname, p.spec.name, rows),))


def write_encoded(src: HFSource, w: SafetensorsWriter, fname: str, p: Planned, pb) -> TensorMeta:
    """Each component in turn, its source tensors copied end to end in the kernel, as they are."""
    components = {}
    for (c, (dt, shape)), (key, _, stored) in zip(p.components.items(), p.stored()):
        for e in p.encoded:
            f, info = src.tensors[e.components[c]]
            if p.fused and p.spec.interleaved > 1:  # gate and up apart along the outputs, as eprt holds them
                w.write(key, p.spec.deinterleave(f.read(e.components[c])).contiguous())
            else:
                w.copy_range(key, f, info.start, info.nbytes)
            pb.update(info.nbytes)
        components[c] = Component(dt, stored, shape, (Part(fname, key, (0, stored[0] if stored else 0)),))
    return meta_of(p, components=components)


def meta_of(p: Planned, parts: tuple[Part, ...] = (), components: dict[str, Component] | None = None) -> TensorMeta:
    """`p`'s manifest entry, its bytes where `parts` say (a raw tensor) or its `components` (an encoded one)."""
    fused = p.spec.sources[0] if p.fused or renamed(p.spec) else None
    if not p.encoded:
        return TensorMeta(
            p.spec.name, p.dtype, p.spec.shape, encodings.RAW, p.role, parts, p.source_dtype, fused_source=fused
        )
    first = p.encoded[0]
    return TensorMeta(
        p.spec.name,
        p.dtype,
        p.spec.shape,
        first.encoding,
        p.role,
        (),
        p.source_dtype,
        first.scheme,
        p.spec.per_row if p.spec.stacked else None,
        components,
        fused_source=fused,
    )


def in_place(src: HFSource, p: Planned) -> bool:
    """Whether the source holds `p` as eprt reads it: encoded weights unless interleaved (their
    components are copied as they are), a raw one when it keeps its dtype and each source tensor is the whole
    tensor (a plain or fused one) or one expert's piece of its row."""
    if p.encoded:
        return not (p.fused and p.spec.interleaved > 1)
    if p.dtype != p.source_dtype or (p.fused and p.spec.permuted):
        return False
    want = p.spec.source_shape() if p.spec.stacked else p.spec.shape
    return all(tuple(src.tensors[s][1].shape) == tuple(want) for s in p.spec.sources)


def referenced(src: HFSource, p: Planned) -> TensorMeta:
    """`p`'s manifest entry, its parts in the source's files: a stacked row's as its pieces."""

    def parts(sources: list[str], stored: tuple[int, ...], stacked: bool) -> tuple[Part, ...]:
        if not stacked:
            (s,) = sources
            return (Part(SOURCE + src.shard_of(s), s, (0, stored[0] if stored else 0)),)
        per_row = p.spec.per_row
        return tuple(
            Part(SOURCE + src.shard_of(s), s, (j // per_row, j // per_row + 1), piece=True)
            for j, s in enumerate(sources)
        )

    if not p.encoded:
        return meta_of(p, parts=parts(list(p.spec.sources), p.spec.shape, p.spec.stacked))
    components = {
        c: Component(dt, stored, shape, parts([e.components[c] for e in p.encoded], stored, p.spec.stacked))
        for (c, (dt, shape)), (_, _, stored) in zip(p.components.items(), p.stored())
    }
    return meta_of(p, components=components)


def renamed(spec: TensorSpec) -> bool:
    """Whether the source spelled this tensor otherwise than eprt names it (eprt.layout.TensorSpec.alias,
    or a plain tensor whose one source has a name of its own: Nemotron-H's `backbone.embeddings`):
    export writes that name back."""
    return not spec.stacked and spec.sources != (spec.name,)


def copy_hf_files(hf_dir: str, tmp: str, chat_template: str | None = None) -> list[str]:
    """Copy every non-weight file of the source byte for byte into `hf/` (and `chat_template` as
    its chat_template.jinja, which wins over a template in tokenizer_config.json)."""
    files = non_weight_files(hf_dir)
    copy_files(hf_dir, files, os.path.join(tmp, HF_FILES))
    if chat_template is None:
        return files
    try:
        shutil.copyfile(chat_template, os.path.join(tmp, HF_FILES, CHAT_TEMPLATE))
    except (FileNotFoundError, IsADirectoryError):
        raise ConfigError(f"--chat-template {chat_template}: no such file; give a Jinja chat template file") from None
    return sorted({*files, CHAT_TEMPLATE})
