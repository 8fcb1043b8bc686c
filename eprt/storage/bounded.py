"""JSON from untrusted files, refused by name however it is broken.

Python's json raises RecursionError (not a decode error) on a document nested a few thousand
levels deep, and a file read in the locale's encoding raises UnicodeDecodeError on bytes that
are not UTF-8: both would escape as a traceback. Here every way a file can fail to be JSON is
one EprtError naming the file and what was wrong.
"""

from __future__ import annotations

import json
from typing import Any

from eprt.errors import ConfigError, EprtError


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
