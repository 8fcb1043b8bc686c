"""Pins of weight files, and a checkpoint's reference to the source directory whose files it reads
in place (`eprt-convert --reference`).

A pin is cheap to take and to check next to reading the file, and it changes when the file does: a
calibrated checkpoint pins its base's weight files, a checkpoint converted by reference the
source's (its parts' files named `SOURCE` + the name in the source directory)."""

from __future__ import annotations

import hashlib
import os
import struct

from eprt.errors import CheckpointError
from eprt.storage.paths import resolve_inside
from eprt.storage.safetensors_io import MAX_HEADER

SOURCE = "source:"  # a part's file in the source directory the manifest references, not in the checkpoint's

# A pin of a weight file: cheap to take and to check next to reading the file, and it changes when
# the file does. Its size and modification time change with any write in place; its header and
# PIN_SAMPLES blocks spread over its data change when it is converted again from another model
# with the same manifest (an unrelated model differs in every block). Copying a base without its
# times (cp without -a) changes the modification time too, and is refused like an edit.
PIN_SAMPLES = 16
PIN_BLOCK = 4096


def weight_pin(path: str) -> dict:
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        h = hashlib.sha256()
        (n,) = struct.unpack("<Q", os.pread(fd, 8, 0).ljust(8, b"\0"))
        data_start = min(8 + n, 8 + MAX_HEADER, st.st_size)  # a file changed into garbage is not read whole
        h.update(os.pread(fd, data_start, 0))  # the header: every tensor's name, dtype, shape and offsets
        span = max(st.st_size - data_start - PIN_BLOCK, 0)
        for i in range(PIN_SAMPLES):
            h.update(os.pread(fd, PIN_BLOCK, data_start + span * i // (PIN_SAMPLES - 1)))
    finally:
        os.close(fd)
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sampled_sha256": h.hexdigest()}


def pin_changes(then: dict, now: dict | None) -> list[str]:
    """What differs between two pins of one file: size, mtime_ns, sampled_sha256 (all, for a file gone)."""
    return [k for k in ("size", "mtime_ns", "sampled_sha256") if now is None or now[k] != then.get(k)]


def weight_pins(ck) -> dict[str, dict]:
    """A pin of each of checkpoint `ck`'s own weight files (those of the source it references too), as they are now."""
    return {f: weight_pin(ck.file_path(f)) for f in ck.weight_files()}


def source_reference(out: str, source: str, files: list[str]) -> dict:
    """How a checkpoint written at `out` refers to the source directory whose weight `files` it reads."""
    source = os.path.realpath(source)
    return {
        "path": os.path.relpath(source, os.path.realpath(out)),
        "abspath": source,
        "weights": {f: weight_pin(resolve_inside(source, f, source)) for f in files},
    }


def open_source(path: str, mpath: str, ref, referenced: list[str]) -> str:
    """The source directory whose weight files the checkpoint at `path` (its manifest `mpath`)
    references (beside it, as moved together, or where it was), once each of them is the file
    pinned at conversion."""
    try:
        candidates = [os.path.normpath(os.path.join(path, ref["path"])), ref["abspath"]]
        pinned = dict(ref["weights"])
        candidates = [c for c in candidates if isinstance(c, str)]
    except (KeyError, TypeError, ValueError):
        raise CheckpointError(
            f"{mpath}: corrupt manifest (its tensors lie in the source's files, but it names no source "
            "with their pins); convert the checkpoint again"
        ) from None
    unpinned = [f for f in referenced if f.removeprefix(SOURCE) not in pinned]
    if unpinned:
        raise CheckpointError(f"{mpath}: corrupt manifest: {unpinned[0]} is not pinned; convert the checkpoint again")
    found = next((c for c in candidates if all(os.path.isfile(os.path.join(c, f)) for f in pinned)), None)
    if found is None:
        raise CheckpointError(
            f"{path}: the source checkpoint whose weight files it reads is gone (looked in "
            f"{' and '.join(candidates)}): restore it there, or convert again"
        )
    for f, pin in pinned.items():
        changed = pin_changes(pin, weight_pin(resolve_inside(found, f, mpath)))
        if changed:
            raise CheckpointError(
                f"{path}: the source's weight file {os.path.join(found, f)}, which it reads in place, "
                f"changed since conversion ({', '.join(changed)} differ): convert again from the current "
                "source (a copy of a source keeps its pins only when it keeps the files' times: cp -a, rsync -a)"
            )
    return found


def check_weight_pins(path: str, base, pinned: dict) -> None:
    """Refuse a base (a checkpoint) whose weight files are not the ones the checkpoint at `path` pinned."""
    if sorted(pinned) != base.weight_files():
        raise CheckpointError(
            f"{path}: it pins the weight files {sorted(pinned)} of its base {base.path}, which "
            f"stores its weights in {base.weight_files()}: calibrate again from the current base"
        )
    for f, pin in pinned.items():
        changed = pin_changes(pin, weight_pin(base.file_path(f)))
        if changed:
            raise CheckpointError(
                f"{path}: its base's weight file {os.path.join(base.path, f)} changed since "
                f"calibration ({', '.join(changed)} differ), so its calibration may not fit the "
                "weights: calibrate again from the current base (a copy of a base keeps its "
                "calibration only when it keeps the files' times: cp -a, rsync -a)"
            )
