"""The work directory held by one run at a time: an exclusive lock, not only a marker.

The marker (eprt.quant.run.workdir.MARKER) says a directory is eprt's; it cannot say that no other run
is using it. Two runs given the same --work-dir would each drop the other's files. Rank 0 of a run
takes an exclusive `flock` on LOCK_FILE inside the directory before it writes or removes anything
there, and holds it until the process ends (the kernel releases it however the process ends, so a
killed run leaves no stale lock). A second run is refused by name while the first holds it. flock
is advisory and local to a host on some network file systems (NFS before v4 locks per client).
"""

from __future__ import annotations

import fcntl
import os

from eprt.errors import ConfigError

LOCK_FILE = ".eprt-work-dir.lock"


# the locks this process holds, by the work directory's real path: a process is one run (a run
# stopped by an exception and resumed in the same process holds its lock still, as flock would)
HELD: dict[str, int] = {}


def hold(work_dir: str) -> int:
    """Take the work directory's lock; returns the descriptor that holds it (closing it releases
    it). Refused, naming the directory and the holder's pid, while another process holds it."""
    key = os.path.realpath(work_dir)
    if key in HELD:
        return HELD[key]
    path = os.path.join(work_dir, LOCK_FILE)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(
            f"--work-dir {work_dir} is in use by another eprt run (pid {holder}); wait for it to end, "
            "or give this run its own --work-dir"
        ) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, str(os.getpid()).encode(), 0)
    HELD[key] = fd
    return fd


def release(work_dir: str, fd: int | None) -> None:
    """Remove the lock file and release the lock (the directory is being removed)."""
    if fd is None:
        return
    HELD.pop(os.path.realpath(work_dir), None)
    try:
        os.remove(os.path.join(work_dir, LOCK_FILE))
    except FileNotFoundError:
        pass
    os.close(fd)
