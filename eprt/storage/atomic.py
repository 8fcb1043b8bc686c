"""Outputs appear atomically: written into a sibling temp directory, fsynced, then renamed.

A failed run leaves nothing that looks finished, and an existing output is replaced only
when asked (`overwrite`), and only once the new one is complete: the new directory and the old
output exchange names in one step (Linux `renameat2(RENAME_EXCHANGE)`), so a run killed at any
moment leaves the old output or the new one at OUT, never neither. Where the file system cannot
exchange names, the old output is first moved aside to `.OUT.old-*`; a kill between that and the
next rename leaves it there, complete, for the user to move back. A run touches no path it did
not create: its temp directory and the old output it replaces get names unique to the run
(pid and random), so two runs writing one output, or a user's own `OUT.old`, are safe; a run
that is killed leaves its hidden `.OUT.partial-*` behind, for the user to remove. The whole
directory is synced once, before the rename; a writer meanwhile has the disk write what it wrote
(eprt.storage.safetensors_io.SYNC_BEHIND_BYTES), so little is left for that sync.

Every file eprt writes, inside such a directory or on its own (a report's page, a work file, a
launcher's verdict), goes through one primitive, `atomic_file` (or `replacing`, for a writer that
takes a path): the bytes go to a new file beside the target, created exclusively and without
following a link (`new_file`: O_EXCL | O_NOFOLLOW), synced, then renamed over the target. A rename
replaces a link at the target rather than writing through it, so a crafted `page.html.tmp ->
~/.ssh/authorized_keys` (or a link at the target itself) is never written through. A write the
file system refuses names its path; whatever fails, the new file is removed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import IO

from eprt.errors import EprtError, OutputExistsError
from eprt.storage.paths import check_relative, hf_cache_blobs, resolve_inside, within


def check_output_dir(out: str, overwrite: bool, inputs: tuple[str, ...] = ()) -> str:
    """Refuse an output that exists non-empty (unless `overwrite`) or that overlaps an input
    (is it, lies inside it, or holds it), whatever `overwrite` says."""
    out = os.path.realpath(out)
    for src in read_dirs(inputs):
        if within(out, src) or within(src, out):
            raise EprtError(
                f"output {out} overlaps the input {src}, which this run reads; choose an output "
                "outside it (and not holding it)"
            )
    if os.path.exists(out):
        if not os.path.isdir(out):
            raise OutputExistsError(f"output {out} exists and is not a directory")
        if os.listdir(out) and not overwrite:
            raise OutputExistsError(f"output {out} exists and is not empty; pass --overwrite to replace it")
    check_writable(out)
    return out


def check_writable(out: str) -> None:
    """Refuse, before any work, an output the file system will not let this run write: a directory
    is made and removed where the output's temp directory will be (in its nearest existing parent,
    as `atomic_output_dir` makes the missing ones)."""
    parent = os.path.dirname(out)
    while not os.path.isdir(parent) and os.path.dirname(parent) != parent:
        parent = os.path.dirname(parent)
    probe = unique_sibling(os.path.join(parent, os.path.basename(out)), "probe")
    with naming_refused_writes(out, f"the output {out}", "write the output elsewhere"):
        try:
            os.mkdir(probe)
        except OSError as e:
            e.filename = out  # the user knows the output by its own name
            raise
        os.rmdir(probe)


def read_dirs(inputs: tuple[str, ...]) -> list[str]:
    """The real directories reading `inputs` may read: each, and the `blobs/` its files link into
    where it is a Hugging Face cache snapshot (eprt.storage.paths)."""
    out = []
    for src in map(os.path.realpath, inputs):
        out.append(src)
        if hf_cache_blobs(src) is not None:
            out.append(os.path.realpath(hf_cache_blobs(src)))
    return out


def unique_sibling(out: str, kind: str) -> str:
    """A hidden name beside `out` that no other run picks: `.NAME.KIND-PID-RANDOM` (beside a link
    itself, not its target)."""
    parent, name = os.path.split(os.path.abspath(out))
    parent = os.path.realpath(parent)
    return os.path.join(parent, f".{name}.{kind}-{os.getpid()}-{secrets.token_hex(6)}")


def temp_dir_for(out: str) -> str:
    """A new temp directory name beside `out`, unique to this run (ranks agree on rank 0's)."""
    return unique_sibling(out, "partial")


# errnos by which a file system refuses a write: the user's to fix, named with the path and whose it is
REFUSED_WRITES = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is exceeded",
    errno.EROFS: "the file system is read-only",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
}


@contextmanager
def naming_refused_writes(path: str, what: str, elsewhere: str):
    """A write the file system refuses (full, over quota, read-only, forbidden) becomes one line
    naming the path (the OSError's own, else `path`), `what` it was writing (the output, a work
    directory) and the way out: free space, or `elsewhere`."""
    try:
        yield
    except OSError as e:
        if e.errno not in REFUSED_WRITES:
            raise
        raise EprtError(
            f"{e.filename or path}: {REFUSED_WRITES[e.errno]} writing {what} ({e.strerror}): free space "
            f"or fix its permissions, or {elsewhere}"
        ) from None


def new_file(path: str, mode: str = "wb", buffering: int = -1) -> IO:
    """`path` opened for writing as a file this call creates: refused (FileExistsError, or ELOOP
    for a link) where anything, a link included, is there already, so no write lands elsewhere."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    try:
        return open(fd, mode, buffering=buffering, **({} if "b" in mode else {"encoding": "utf-8"}))
    except BaseException:
        os.close(fd)
        raise


@contextmanager
def replacing(path: str, what: str = "a file", elsewhere: str = "write it elsewhere") -> Iterator[str]:
    """Yields a new name beside `path` for the writer to create (with `new_file`); once it returns, the
    file is synced and renamed over `path`. `path` may not be a directory; a write the file system
    refuses names `path` and `what` it was, with the way out (`elsewhere`); on any error the new
    file is removed."""
    if os.path.isdir(path) and not os.path.islink(path):
        raise EprtError(f"{path} is a directory; name a file to write {what} to")
    tmp = unique_sibling(path, "partial")
    try:
        with naming_refused_writes(path, what, elsewhere):
            try:
                yield tmp
                fsync_path(tmp)
                os.rename(tmp, path)  # replaces a link at `path` itself, never its target
                fsync_path(os.path.dirname(os.path.abspath(path)))
            except OSError as e:
                if e.filename == tmp:  # the user knows the file by its own name
                    e.filename = path
                raise
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


@contextmanager
def atomic_file(
    path: str, mode: str = "w", what: str = "a file", elsewhere: str = "write it elsewhere"
) -> Iterator[IO]:
    """`path` written whole or not at all (`replacing`): yields the new file, open in `mode` ("w", UTF-8 text, or "wb")."""
    with replacing(path, what, elsewhere) as tmp, new_file(tmp, mode) as f:
        yield f


def write_file(path: str, data: str | bytes, what: str = "a file", elsewhere: str = "write it elsewhere") -> None:
    """`data` as the whole of `path` (`atomic_file`)."""
    with atomic_file(path, "wb" if isinstance(data, bytes) else "w", what, elsewhere) as f:
        f.write(data)


def fsync_path(path: str) -> None:
    """Make a file's bytes, or a directory's entries, durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sync_tree(root: str) -> None:
    """fsync every file and directory under `root`: what was written there is on disk. A file gone
    by the time it is reached was another rank's new file, synced by its writer and renamed
    (`replacing`) meanwhile: its new name is synced by whoever reaches it."""
    for d, _, files in os.walk(root):
        for name in files:
            try:
                fsync_path(os.path.join(d, name))
            except FileNotFoundError:
                pass
        fsync_path(d)


def copy_files(src_dir: str, files: list[str], dst_dir: str) -> None:
    """Copy files (paths relative to `src_dir`) byte for byte; each must lie inside `src_dir`
    (eprt.storage.paths) and lands inside `dst_dir`."""
    for rel in files:
        src = resolve_inside(src_dir, rel, f"{src_dir} (a file to copy)")
        dst = os.path.join(dst_dir, check_relative(rel, f"{src_dir} (a file to copy)"))
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        copy_file(src, dst)


def copy_file(src: str, dst: str) -> None:
    """`src`'s bytes as `dst`, written as every file is (`atomic_file`)."""
    with open(src, "rb") as s, atomic_file(dst, "wb") as d:
        shutil.copyfileobj(s, d, COPY_CHUNK)


COPY_CHUNK = 1 << 20


def publish(tmp: str, out: str, overwrite: bool = False) -> None:
    """Sync the finished temp directory and move it into place. An output that exists by then
    (another run may have made it meanwhile) is replaced only with `overwrite`: the two exchange
    names, and the old one, now under the temp name, is removed."""
    parent = os.path.dirname(os.path.abspath(out))  # a relative `out` has none of its own
    sync_tree(tmp)
    try:
        os.rename(tmp, out)  # succeeds when `out` is absent or an empty directory
    except OSError as e:
        if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        if not overwrite:
            raise OutputExistsError(
                f"output {out} appeared, not empty, while this run wrote it (another run?); "
                "it was left as it is: pass --overwrite to replace it, or choose another "
                "output"
            ) from None
        old = tmp if exchange_names(tmp, out) else replace_aside(tmp, out)
        fsync_path(parent)
        shutil.rmtree(old, ignore_errors=True)
        return
    fsync_path(parent)


RENAME_EXCHANGE = 2  # linux/fs.h
AT_FDCWD = -100
# errnos by which a kernel or file system says it cannot exchange two names
EXCHANGE_UNSUPPORTED = (errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


def exchange_names(a: str, b: str) -> bool:
    """Swap the directories `a` and `b` in one step; False where this system cannot (nothing moved)."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if renameat2 is None:  # glibc before 2.28, or not Linux
        return False
    if renameat2(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in EXCHANGE_UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err), b)


def replace_aside(tmp: str, out: str) -> str:
    """Without an exchange: `out` moved aside to a name unique to this run, then `tmp` into its
    place (the old output is moved back if that fails); returns where the old output is."""
    old = unique_sibling(out, "old")
    os.rename(out, old)
    try:
        os.rename(tmp, out)
    except BaseException:
        os.rename(old, out)
        raise
    return old


@contextmanager
def atomic_output_dir(out: str, *, overwrite: bool = False, inputs: tuple[str, ...] = ()):
    """Yields a temp directory; on success it becomes `out`, on any error it is removed."""
    out = check_output_dir(out, overwrite, inputs)
    tmp = temp_dir_for(out)
    os.makedirs(tmp)
    try:
        yield tmp
        publish(tmp, out, overwrite)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
