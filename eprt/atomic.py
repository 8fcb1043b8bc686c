"""Outputs appear atomically: written into a sibling temp directory, fsynced, then renamed.

A failed run leaves nothing that looks finished, and an existing output is replaced only
when asked (`overwrite`), and only once the new one is complete. Writers do not fsync file by
file: the whole directory is synced once, before the rename, so the kernel writes one file back
while the next is being written.
"""

from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

from eprt.errors import EprtError, OutputExistsError


def check_output_dir(out: str, overwrite: bool, inputs: tuple[str, ...] = ()) -> str:
    """Refuse an output that exists non-empty (unless `overwrite`) or that overlaps an input."""
    out = os.path.realpath(out)
    for src in inputs:
        src = os.path.realpath(src)
        if out == src or out.startswith(src + os.sep) or src.startswith(out + os.sep):
            raise EprtError(f"output {out} overlaps the input {src}; choose an output outside it")
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise OutputExistsError(f"output {out} exists and is not a directory")
        if os.listdir(out) and not overwrite:
            raise OutputExistsError(f"output {out} exists and is not empty; pass --overwrite to replace it")
    return out


def temp_dir_for(out: str) -> str:
    """The temp directory beside `out`; the same on every rank, so that ranks can share it."""
    parent, name = os.path.split(os.path.realpath(out))
    return os.path.join(parent, f".{name}.partial")


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: str) -> None:
    """fsync every file and directory under `root`: what was written there is on disk."""
    for d, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(d, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(d)


def copy_files(src_dir: str, files: list[str], dst_dir: str) -> None:
    """Copy files (paths relative to `src_dir`) byte for byte."""
    for rel in files:
        dst = os.path.join(dst_dir, rel)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(os.path.join(src_dir, rel), dst)


def publish(tmp: str, out: str) -> None:
    """Sync the finished temp directory and move it into place, replacing an old output last."""
    sync_tree(tmp)
    old = None
    if os.path.exists(out):
        old = out + ".old"
        shutil.rmtree(old, ignore_errors=True)
        os.rename(out, old)
    os.rename(tmp, out)
    fsync_dir(os.path.dirname(out))
    if old:
        shutil.rmtree(old, ignore_errors=True)


@contextmanager
def atomic_output_dir(out: str, *, overwrite: bool = False, inputs: tuple[str, ...] = ()):
    """Yields a temp directory; on success it becomes `out`, on any error it is removed."""
    out = check_output_dir(out, overwrite, inputs)
    tmp = temp_dir_for(out)
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run that was killed
    os.makedirs(tmp)
    try:
        yield tmp
        publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
