"""JSON from untrusted files, refused by name however it is broken.

Python's json raises RecursionError (not a decode error) on a document nested a few thousand
levels deep, and a file read in the locale's encoding raises UnicodeDecodeError on bytes that
are not UTF-8: both would escape as a traceback. Here every way a file can fail to be JSON is
one EprtError naming the file and what was wrong.
"""

from __future__ import annotations

import json
import os
import stat
from typing import IO, Any

from eprt.errors import ConfigError, EprtError
from eprt.units import format_bytes


def parse_json(data: bytes | str, where: str, way_out: str, error: type[EprtError] = ConfigError) -> Any:
    """The JSON value of `data`, or `error` naming `where` and `way_out` (the fix, in words)."""
    try:
        return json.loads(data)
    except UnicodeDecodeError as e:
        raise error(f"{where}: not UTF-8 text (byte {e.start}); {way_out}") from None
    except json.JSONDecodeError as e:
        raise error(f"{where}: not valid JSON ({e}); {way_out}") from None
    except RecursionError:
        raise error(
            f"{where}: nested too deeply to be read (thousands of levels of lists or objects); {way_out}"
        ) from None


def open_regular(path: str, way_out: str, error: type[EprtError] = ConfigError) -> IO[bytes]:
    """`path` open for reading, refused unless it is a regular file: a FIFO or a device would block
    or never end (opened without blocking, then checked, so a FIFO cannot hold the open)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise error(f"{path}: not a regular file (a pipe, device or socket); {way_out}")
        os.set_blocking(fd, True)
        return open(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_bounded(path: str, most: int, way_out: str, error: type[EprtError] = ConfigError) -> bytes:
    """The bytes of the regular file `path`, refused by name where it holds more than `most`."""
    with open_regular(path, way_out, error) as f:
        data = f.read(most + 1)
    if len(data) > most:
        raise error(f"{path}: larger than {format_bytes(most)}, the most eprt reads of such a file; {way_out}")
    return data


def read_json(path: str, way_out: str, error: type[EprtError] = ConfigError) -> Any:
    """The JSON value of the file `path` (read as bytes: UTF-8 whatever the locale)."""
    with open(path, "rb") as f:
        return parse_json(f.read(), path, way_out, error)


def read_json_object(path: str, way_out: str, error: type[EprtError] = ConfigError) -> dict:
    """`read_json`, refusing anything but a JSON object."""
    value = read_json(path, way_out, error)
    if not isinstance(value, dict):
        raise error(f"{path}: holds a JSON {type(value).__name__}, not an object; {way_out}")
    return value
