"""The files of an export as the checks read them: config JSON, and from the safetensors shards the
index names (or the single file) every tensor's header, plus the values of its scales. Only
headers and scale tensors are read, never the quantized weights; every file read lies inside
the export (eprt.storage.paths), and what the index and the shards disagree on is a problem.

The headers are read through the safetensors library, which the engines load with; the scales'
values by byte range (eprt.storage.safetensors_io), not through the library's mapping of the
file: the export has just written its shards, their pages are in the page cache, and a scale read
through the mapping makes the pages around it resident too, so that reading a shard's scales
mapped most of the shard (190 of the 225 MiB of an NVFP4 weights-only export). Read by range, the
check holds one scale tensor at a time, less than the export held quantizing the weight it scales.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from eprt.errors import CheckpointError
from eprt.hf.check_kv import KV_SCALES
from eprt.quant.formats import WEIGHT_FORMATS
from eprt.quant.formats.e8m0 import BIAS as E8M0_BIAS
from eprt.quant.formats.e8m0 import NAN as E8M0_NAN
from eprt.storage.hf_files import INDEX, SINGLE
from eprt.storage.paths import resolve_inside
from eprt.storage.safetensors_io import SafetensorsFile

# The leaves whose values are read: every format's scales in either layout, and the KV cache's.
SCALE_LEAVES = {
    leaf for f in WEIGHT_FORMATS.values() for leaves in (f.modelopt_leaves, tuple(f.ct_leaves)) for leaf in leaves[1:]
} | set(KV_SCALES)
MXFP4_SCALES = "_scales"
SMALL_INTS = 8  # an integer "scale" leaf this small is read whole: a packed weight's weight_shape


@dataclass
class StoredTensor:
    dtype: str  # safetensors spelling: F32, BF16, F8_E4M3, U8, ...
    shape: tuple[int, ...]
    value: float | None = None  # one-element scales: the value
    bad_block_scales: int = 0  # block-scale grids: how many are zero, negative or NaN
    block_range: tuple[float, float] | None = None  # block-scale grids: the smallest and largest valid scale
    ints: tuple[int, ...] | None = None  # small integer tensors (a packed weight's weight_shape): the values


def read_json(path: Path, problems: list[str]) -> dict | None:
    if not path.exists():
        problems.append(f"{path.name}: missing")
        return None
    if not inside(path.parent, path.name, path.name, problems):
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{path.name}: not readable JSON ({e})")
        return None
    if not isinstance(data, dict):
        problems.append(f"{path.name}: not a JSON object")
        return None
    return data


def read_tensors(out: Path, problems: list[str]) -> dict[str, StoredTensor]:
    """Header of every tensor, and the values of the scales, from the shards the index names."""
    on_disk = sorted(p.name for p in out.glob("*.safetensors"))
    weight_map = None
    if (out / INDEX).exists():
        index = read_json(out / INDEX, problems)
        weight_map = index.get("weight_map") if index else None
        if not isinstance(weight_map, dict):
            problems.append(f"{INDEX}: no weight_map object")
            return {}
        shards = _indexed_shards(out, weight_map, problems)
        named = {s for s in weight_map.values() if isinstance(s, str)}
        for name in on_disk:
            if name not in named:
                problems.append(f"{name}: shard not named in {INDEX} weight_map; engines load only indexed shards")
    elif (out / SINGLE).exists():
        shards = [SINGLE] if inside(out, SINGLE, SINGLE, problems) else []
        for name in on_disk:
            if name != SINGLE:
                problems.append(f"{name}: shard beside {SINGLE} without {INDEX}")
    else:
        problems.append(f"{out}: neither {INDEX} nor {SINGLE}")
        return {}

    tensors: dict[str, StoredTensor] = {}
    read = set()
    for shard in shards:
        if not (out / shard).exists():
            problems.append(f"{shard}: named in {INDEX} weight_map but missing")
            continue
        try:
            names = _read_shard(out / shard, tensors, problems)
        except Exception as e:  # a corrupt file may fail in many ways; name it and go on
            problems.append(f"{shard}: not a readable safetensors file ({e})")
            continue
        read.add(shard)
        if weight_map is not None:
            for name in names:
                mapped = weight_map.get(name)
                if name not in weight_map:
                    problems.append(f"{name}: in {shard} but not in {INDEX} weight_map")
                elif isinstance(mapped, str) and mapped != shard:  # not a file name: said above
                    problems.append(f"{name}: in {shard} but {INDEX} weight_map says {mapped}")
    if weight_map is not None:
        for name, shard in sorted(weight_map.items()):
            if name not in tensors and shard in read:
                problems.append(f"{name}: in {INDEX} weight_map but not in {shard}")
    return tensors


def _indexed_shards(out: Path, weight_map: dict, problems: list[str]) -> list[str]:
    """The shards the index names that an engine would read from inside the export: a name that is
    not a file name, or one that leaves the directory (`../x`, a link out), is refused and not read."""
    named = set()
    for name, shard in sorted(weight_map.items()):
        if isinstance(shard, str):
            named.add(shard)
        else:
            problems.append(f"{INDEX}: weight_map maps {name} to {shard!r}, not a shard's file name")
    return [s for s in sorted(named) if inside(out, s, INDEX, problems)]


def inside(out: Path, rel: str, where: str, problems: list[str]) -> bool:
    try:
        resolve_inside(str(out), rel, where)
    except CheckpointError as e:
        problems.append(str(e))
        return False
    return True


def _read_shard(path: Path, tensors: dict[str, StoredTensor], problems: list[str]) -> list[str]:
    with safe_open(path, framework="pt") as f, SafetensorsFile(str(path)) as values:
        names = list(f.keys())
        for name in names:
            if name in tensors:
                problems.append(f"{name}: stored twice (again in {path.name})")
                continue
            piece = f.get_slice(name)
            t = StoredTensor(piece.get_dtype(), tuple(piece.get_shape()))
            leaf = name.rsplit(".", 1)[-1]
            # the named scales of the formats, and the E8M0 scales of MXFP4 blocks (`P_scales`)
            if leaf in SCALE_LEAVES or leaf.endswith(MXFP4_SCALES):
                if t.dtype in ("I32", "I64") and math.prod(t.shape) <= SMALL_INTS:
                    t.ints = tuple(int(v) for v in values.read(name).reshape(-1).tolist())
                if math.prod(t.shape) == 1:  # a per-tensor scale, or a grid of one block (both checked as a grid)
                    t.value = values.read(name).float().item()
                if t.dtype == "F8_E4M3":
                    raw = values.read(name).view(torch.uint8)
                    # 0x00/0x80 are zeros, 0x7F/0xFF NaN, and 0x80 upwards negative.
                    bad = (raw == 0) | (raw >= 0x7F)
                    t.bad_block_scales = int(bad.sum())
                    valid = raw[~bad] if t.bad_block_scales else raw
                    if valid.numel():  # positive E4M3 codes order as their values
                        codes = torch.stack([valid.min(), valid.max()]).view(torch.float8_e4m3fn).float()
                        t.block_range = (codes[0].item(), codes[1].item())
                elif t.dtype == "U8":  # an E8M0 grid (MXFP8, MXFP4): every byte a power of two but 255, NaN
                    codes = values.read(name)
                    nan = codes == E8M0_NAN
                    t.bad_block_scales = int(nan.sum())
                    # code 0 (2^-127) is an all-zero block's scale: what it can encode (under 3e-36) is zero
                    valid = codes[~nan & (codes > 0)]
                    if valid.numel():  # checked as the values the engines decode (eprt.hf.check_scale_range)
                        t.block_range = (2.0 ** (int(valid.min()) - E8M0_BIAS), 2.0 ** (int(valid.max()) - E8M0_BIAS))
                elif t.dtype in ("F32", "BF16"):  # an fp32 (FP8 block) or bf16 (INT4) block-scale grid
                    grid = values.read(name)
                    bad = ~((grid > 0) & grid.isfinite())
                    t.bad_block_scales = int(bad.sum())
                    valid = grid[~bad]
                    if valid.numel():
                        t.block_range = (valid.min().item(), valid.max().item())
            tensors[name] = t
    return names
