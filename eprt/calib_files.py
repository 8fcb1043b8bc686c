"""The files of a calibration source, read bounded: what a file holds (text, JSON rows, a table, a
saved dataset, token ids), each document as a reader of its next characters, and token ids by the
rows that hold them. eprt.data turns these into sequences."""

from __future__ import annotations

import codecs
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch

from eprt.errors import CheckpointError, ConfigError
from eprt.storage.bounded import open_regular, parse_json, read_bounded
from eprt.storage.chat_template import chat_renderer
from eprt.storage.safetensors_io import SafetensorsFile
from eprt.storage.tables import dataset_rows, parquet_rows
from eprt.units import format_bytes

# what a source holds (source_kind)
DATASET, PARQUET, JSON_LINES, JSON_ARRAY, NPY, SAFETENSORS, TEXT_FILE = (
    "dataset",
    "parquet",
    "jsonl",
    "json array",
    "npy",
    "safetensors",
    "text",
)
KIND_OF_SUFFIX = {
    ".parquet": PARQUET,
    ".jsonl": JSON_LINES,
    ".ndjson": JSON_LINES,
    ".json": JSON_LINES,  # or an array: by its first byte
    ".npy": NPY,
    ".safetensors": SAFETENSORS,
    ".txt": TEXT_FILE,
}
TOKEN_ID_KINDS = (NPY, SAFETENSORS)
SNIFF_BYTES = 4096
WAY_OUT = "give a file (.txt, .jsonl, .json, .parquet, .npy, .safetensors) or a saved dataset"
# a JSONL line or a table row is decoded whole: beyond this it is refused before it is decoded
MAX_ROW_BYTES = 16 << 20
MAX_ARRAY_BYTES = 256 << 20  # a .json array is parsed whole
ROW_SHAPE = 'each row is one JSON object {"text": ...} or {"messages": [...]}'
# the columns (JSONL fields) read by default, in order: plain text, else a conversation
TEXT, MESSAGES = "text", "messages"


def choose_column(column: str | None) -> Callable[[list[str]], str]:
    """Which column of a table to read: `column` (--calib-column), else text, else messages."""

    def choose(columns: list[str]) -> str:
        if column is not None:
            return column
        return MESSAGES if TEXT not in columns and MESSAGES in columns else TEXT

    return choose


def bounded_lines(f, path: str) -> Iterator[bytes]:
    """The lines of binary file `f`, each refused by number before it is decoded where it is longer
    than MAX_ROW_BYTES (a line is parsed whole: its size is the memory its row costs)."""
    for i in itertools.count(1):
        raw = f.readline(MAX_ROW_BYTES + 1)
        if not raw:
            return
        if len(raw) > MAX_ROW_BYTES:
            raise ConfigError(
                f"{path}:{i}: a line longer than {format_bytes(MAX_ROW_BYTES)}; calibration reads a few "
                "thousand tokens of a document: cut the document, or give it as a .txt file (read a "
                "prefix at a time)"
            )
        yield raw


def jsonl_rows(f, path: str, column: str | None) -> Iterator[tuple[str, Any]]:
    """(line, the value of its field) of each non-blank line of the open .jsonl file `f`."""
    offset = 0
    for i, raw in enumerate(bounded_lines(f, path), 1):
        line = decode_utf8(raw, path, offset)
        offset += len(raw)
        if not line.strip():
            continue
        where = f"{path}:{i}"
        yield where, row_field(parse_json(line, where, ROW_SHAPE), where, column)


def json_array_rows(path: str, column: str | None) -> Iterator[tuple[str, Any]]:
    """(item, the value of its field) of each object of a .json file holding one array of rows."""
    data = read_bounded(path, MAX_ARRAY_BYTES, "write it as .jsonl, one row per line, read a line at a time")
    rows = parse_json(data, path, ROW_SHAPE)
    if not isinstance(rows, list):
        raise ConfigError(f"{path}: a JSON {type(rows).__name__}; a .json source is an array of rows [{ROW_SHAPE}]")
    for i, row in enumerate(rows):
        yield f"{path}[{i}]", row_field(row, f"{path}[{i}]", column)


def row_field(row: Any, where: str, column: str | None) -> Any:
    """The field of one JSON row that calibration reads: `column`, else text, else messages."""
    if not isinstance(row, dict):
        raise ConfigError(f'{where}: each line needs a string field "text" or a list "messages"')
    key = column or (TEXT if TEXT in row or MESSAGES not in row else MESSAGES)
    if key not in row:
        raise ConfigError(
            f'{where}: each line needs a string field "text" or a list "messages"'
            if column is None
            else f"{where}: no field {key!r} (--calib-column {key})"
        )
    return row[key]


def documents(path: str, hf_dir: str, column: str | None = None) -> Iterator[Callable[[int], str]]:
    """Each document of a source, as a reader giving the next n characters of its text ('' at its
    end): a .txt file (the whole file), or each row of a .jsonl file, a .parquet file or a saved
    dataset: a string (`text`) or a conversation (`messages`: a list of {"role", "content"}),
    rendered with the checkpoint's chat template. The source is read as far as its documents are
    asked for."""
    kind = source_kind(path)
    if kind == DATASET:
        rows: Iterator[tuple[str, Any]] = (
            (f"{path} row {i}", v) for i, v in enumerate(dataset_rows(path, choose_column(column)))
        )
    elif kind == PARQUET:
        rows = ((f"{path} row {i}", v) for i, v in enumerate(parquet_rows(path, choose_column(column))))
    elif kind == JSON_ARRAY:
        rows = json_array_rows(path, column)
    elif kind == JSON_LINES:
        with open_regular(path, WAY_OUT) as f:
            yield from row_documents(jsonl_rows(f, path, column), path, hf_dir)
        return
    else:
        with open_regular(path, WAY_OUT) as f:
            yield utf8_reader(f, path)
        return
    yield from row_documents(rows, path, hf_dir)


def source_kind(path: str) -> str:
    """What a calibration source holds, by its suffix in any case (`CHATS.JSONL`) and by its first
    bytes: a .json file holding an array is rows, not text; a file of another suffix is Parquet or
    NumPy by its magic bytes, JSON rows where its first line is one, else text."""
    if os.path.isdir(path):
        return DATASET
    suffix = os.path.splitext(path)[1].lower()
    with open_regular(path, WAY_OUT) as f:  # a FIFO or a device is refused here, never read
        head = f.read(SNIFF_BYTES)
    first = head.lstrip()[:1]
    if suffix in KIND_OF_SUFFIX:
        kind = KIND_OF_SUFFIX[suffix]
        return JSON_ARRAY if kind == JSON_LINES and first == b"[" else kind
    if head.startswith(b"PAR1"):
        return PARQUET
    if head.startswith(b"\x93NUMPY"):
        return NPY
    if first in (b"{", b"[") and looks_like_rows(head):
        return JSON_ARRAY if first == b"[" else JSON_LINES
    return TEXT_FILE


def looks_like_rows(head: bytes) -> bool:
    """Whether the start of a file is JSON rows: a first line (or array item) that is an object
    with a text or messages field."""
    line = head.lstrip().lstrip(b"[").split(b"\n", 1)[0].rstrip().rstrip(b",")
    try:
        row = json.loads(line)
    except (ValueError, RecursionError):
        return False
    return isinstance(row, dict) and (TEXT in row or MESSAGES in row)


def row_documents(rows: Iterator[tuple[str, Any]], path: str, hf_dir: str) -> Iterator[Callable[[int], str]]:
    """Each row's text: a string as it is, a conversation through the chat template (read once, when
    the first conversation comes)."""
    render = None
    for where, value in rows:
        if isinstance(value, str):
            yield text_reader(value)
            continue
        if not isinstance(value, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in value
        ):
            raise ConfigError(
                f"{where}: holds a {type(value).__name__}, neither text (a string) nor a conversation "
                '(a list of {"role": ..., "content": ...}); name the right column with '
                "--calib-column"
            )
        render = render or chat_renderer(hf_dir, path)
        yield text_reader(render([with_text_content(m, f"{where} message {i}") for i, m in enumerate(value)], where))


def with_text_content(message: dict, where: str) -> dict:
    """`message` with its content as text: a string as it is, a list of parts (the multimodal
    form) its text parts joined; anything else (null, a number, an image part) is refused by name
    rather than rendered as Python would print it."""
    content = message.get("content")
    if isinstance(content, str):
        return message
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            if kind != "text" or not isinstance(part.get("text"), str):
                raise ConfigError(
                    f"{where}: content part {j} is {kind!r:.40}, not text; calibration reads text: "
                    'give {"type": "text", "text": ...} parts or a string'
                )
            texts.append(part["text"])
        return {**message, "content": "".join(texts)}
    raise ConfigError(
        f"{where}: content is {'null' if content is None else type(content).__name__}, not text; each "
        'message is {"role": ..., "content": "..."}'
    )


def text_reader(text: str) -> Callable[[int], str]:
    """`text`, n characters at a time (io.StringIO would copy it four bytes a character)."""
    at = 0

    def read(n: int) -> str:
        nonlocal at
        piece = text[at : at + n]
        at += len(piece)
        return piece

    return read


def decode_utf8(data: bytes, path: str, offset: int) -> str:
    """`data`, read from byte `offset` of `path`, as UTF-8 text."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise not_utf8(path, offset + e.start) from None


def not_utf8(path: str, byte: int) -> ConfigError:
    return ConfigError(
        f"{path}: not UTF-8 text (byte {byte}); calibration text is UTF-8 "
        '(.txt, or .jsonl with one {"text": ...} per line)'
    )


def utf8_reader(f, path: str) -> Callable[[int], str]:
    """The text of binary file `f`, n characters (at most) at a time."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    offset = 0  # bytes handed to the decoder so far

    def read(n: int) -> str:
        nonlocal offset
        data = f.read(n)
        try:
            text = decoder.decode(data, final=not data)
        except UnicodeDecodeError as e:  # e.start counts in the decoder's pending bytes, then `data`
            raise not_utf8(path, offset - len(decoder.getstate()[0]) + e.start) from None
        offset += len(data)
        return text

    return read


def read_token_ids(path: str, need: int) -> np.ndarray:
    """The first `need` token ids (row-major) of a .npy file (any integer array) or a .safetensors
    file (tensor `input_ids`, or its only tensor), reading only the rows that hold them."""
    ids = npy_token_ids(path) if source_kind(path) == NPY else safetensors_token_ids(path, need)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"{path}: token ids must be integers, found {ids.dtype}")
    if ids.ndim > 1:  # the rows holding the first `need` ids, never the array
        row = math.prod(ids.shape[1:])
        ids = ids[: -(-need // row) if row else 0]
    return np.array(ids.reshape(-1)[:need], dtype=np.int64)


def npy_token_ids(path: str) -> np.ndarray:
    """The array of a .npy file, mapped (nothing read until used), its declared size checked
    against the bytes the file holds."""
    not_npy = f"{path}: not a NumPy .npy array of token ids"
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = {
                (1, 0): np.lib.format.read_array_header_1_0,
                (2, 0): np.lib.format.read_array_header_2_0,
            }.get(version)
            if read_header is None:
                raise ValueError(f"format version {version[0]}.{version[1]}, which token ids are not saved in")
            shape, fortran_order, dtype = read_header(f)
        except (ValueError, OSError, EOFError, SyntaxError) as e:
            raise ConfigError(f"{not_npy} ({e})") from None
        offset = f.tell()
    if not np.issubdtype(dtype, np.integer):
        raise ConfigError(f"{path}: token ids must be integers, found {dtype}")
    count = math.prod(shape)
    held = os.path.getsize(path) - offset
    if count * dtype.itemsize > held:
        raise ConfigError(
            f"{path}: declares {count} token ids of shape {list(shape)} but holds {held} bytes of "
            f"data ({held // dtype.itemsize} ids): the file is truncated or damaged; save it again"
        )
    if count == 0:
        return np.empty(shape, dtype)
    return np.memmap(path, dtype, mode="r", offset=offset, shape=shape, order="F" if fortran_order else "C")


def safetensors_token_ids(path: str, need: int) -> np.ndarray:
    """The token ids of a .safetensors file: the rows holding the first `need`, read by byte range
    (the header checked first: a tensor the file cannot hold is refused before anything is read)."""
    try:
        with SafetensorsFile(path) as f:
            if "input_ids" not in f.tensors and len(f.tensors) != 1:
                raise ConfigError(f"{path}: holds {sorted(f.tensors)}; name the token ids `input_ids`")
            t = f.tensors.get("input_ids") or next(iter(f.tensors.values()))
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise ConfigError(f"{path}: token ids must be integers, found {t.dtype}")
            if not t.shape:
                return f.read(t.name).to(torch.int64).numpy()
            row = math.prod(t.shape[1:])
            rows = min(t.shape[0], -(-need // row) if row else 0)
            return f.read(t.name, rows=(0, rows)).to(torch.int64).numpy()
    except CheckpointError as e:
        raise ConfigError(f"{path}: not a safetensors file of token ids ({str(e).removeprefix(path + ': ')})") from None
