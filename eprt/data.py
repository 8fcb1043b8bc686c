"""Calibration data: text, JSONL, chat conversations, tables or token ids, packed into sequences.

A source is a file or a saved dataset; several may be given, each with its share of the
sequences (`--calib chat.jsonl:0.7 --calib code.txt:0.3`). The global list of sequences depends
only on the data and (num_samples, seq_len); the layer-major engine gives each rank every
world-th sequence of it (eprt.quant.loop.sequences.own_sequences), so the set calibrated is the same at
every layout. What was taken of each source is recorded (`SourceUse`): the calibrated checkpoint
and the quality report keep it.
"""

from __future__ import annotations

import codecs
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any, NamedTuple

import numpy as np
import torch

from eprt.errors import CheckpointError, ConfigError
from eprt.progress import logger, rank
from eprt.storage.bounded import open_regular, parse_json, read_bounded, read_json
from eprt.storage.chat_template import chat_renderer, checkpoint_file
from eprt.storage.hf_files import CONFIG, GENERATION_CONFIG, TOKENIZER
from eprt.storage.safetensors_io import SafetensorsFile
from eprt.storage.tables import dataset_rows, is_saved_dataset, parquet_rows
from eprt.units import format_bytes

BUILTIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "calib.txt")
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
MAX_TOKENIZER_BYTES = 256 << 20  # released tokenizer.json files are a few MiB to a few tens
ROW_SHAPE = 'each row is one JSON object {"text": ...} or {"messages": [...]}'
# the columns (JSONL fields) read by default, in order: plain text, else a conversation
TEXT, MESSAGES = "text", "messages"


# A document is tokenized a prefix at a time: the first holds this many characters, plus this
# many a token needed (about four times what a token spans in English text).
FIRST_CHARS = 4096
CHARS_PER_TOKEN = 16


@dataclass(frozen=True)
class Source:
    """One --calib: a path and its share of the sequences."""

    path: str
    share: float


@dataclass
class SourceUse:
    """What calibration took from one source, as recorded in the calibrated checkpoint and the report."""

    path: str
    share: float
    sequences: int = 0  # calibration sequences from it
    held_out: int = 0  # the quality report's held-out sequences from it
    tokens: int = 0  # tokens read from it (the end-of-sequence token after each document included)
    documents: int | None = None  # texts or conversations read (None: token ids)
    truncated: int = 0  # documents cut short because the tokens needed ended inside them
    repeated: bool = False  # the source held fewer tokens than its sequences: they repeat it from its start

    def to_json(self) -> dict:
        return asdict(self)


def parse_sources(calib: str | Sequence[str] | None) -> list[Source]:
    """The sources of --calib: one path (its share the whole), or several `path:share` whose shares
    sum to 1. None: the built-in corpus."""
    specs = [calib] if isinstance(calib, str) else list(calib or [BUILTIN])
    parsed = []
    for spec in specs:
        path, sep, share = spec.rpartition(":")
        try:
            parsed.append((path, float(share)) if sep and path else (spec, None))
        except ValueError:  # a ':' that is part of the path
            parsed.append((spec, None))
    if len(parsed) == 1 and parsed[0][1] is None:
        return [Source(parsed[0][0], 1.0)]
    missing = [p for p, share in parsed if share is None]
    if missing:
        raise ConfigError(
            f"--calib {missing[0]}: with several --calib, give each its share of the sequences "
            f"(--calib {missing[0]}:0.5)"
        )
    bad = [(p, share) for p, share in parsed if not 0 < share <= 1]
    if bad:
        raise ConfigError(f"--calib {bad[0][0]}:{bad[0][1]:g}: a share is a fraction in (0, 1]")
    total = sum(share for _, share in parsed)
    if not math.isclose(total, 1.0, abs_tol=1e-6):
        raise ConfigError(f"--calib shares sum to {total:g}; they are fractions of the sequences and sum to 1")
    return [Source(p, share) for p, share in parsed]


def check_sources(calib: str | Sequence[str] | None, flag: str = "--calib") -> list[Source]:
    """The sources, each refused by name where it is not a file or a saved dataset."""
    sources = parse_sources(calib)
    for s in sources:
        if os.path.isdir(s.path) and not is_saved_dataset(s.path):
            raise ConfigError(
                f"{flag} {s.path}: a directory, but not a dataset saved with the datasets library's "
                "save_to_disk (it has no state.json or dataset_dict.json)"
            )
        if not os.path.exists(s.path):
            raise ConfigError(f"{flag} {s.path}: no such file")
    return sources


def split_counts(n: int, shares: Sequence[float]) -> list[int]:
    """`n` split by `shares` (largest remainders; a tie goes to the source given first)."""
    exact = [n * s for s in shares]
    counts = [math.floor(x) for x in exact]
    order = sorted(range(len(shares)), key=lambda i: (-(exact[i] - counts[i]), i))
    for i in order[: n - sum(counts)]:
        counts[i] += 1
    return counts


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


def leading_tokens(tok, read: Callable[[int], str], need: int) -> tuple[list[int], bool]:
    """The first `need` tokens of the document `read` gives (all of them where it has fewer), and
    whether the document goes on past them, tokenizing a few times the text they span, never the
    whole of a long document.

    A prefix of a text tokenizes as the whole text does except near the cut, where a word (or a
    merge) may go on past it: the first `need` tokens of a prefix are taken once they are more
    than `need` and a prefix twice as long begins with the same ones."""
    text = read(FIRST_CHARS + need * CHARS_PER_TOKEN)
    ids = tok.encode(text, add_special_tokens=False).ids
    while True:
        more = read(len(text))
        if not more:
            return ids[:need], len(ids) > need
        text += more
        longer = tok.encode(text, add_special_tokens=False).ids
        if len(ids) > need and longer[:need] == ids[:need]:
            return ids[:need], True
        ids = longer


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


def eos_id(hf_dir: str) -> int | None:
    for name in (GENERATION_CONFIG, CONFIG):
        p = checkpoint_file(hf_dir, name)
        if os.path.isfile(p):
            cfg = read_json(
                p,
                "text calibration reads the end-of-sequence token there: fix the file in the source and convert again",
            )
            eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                if type(eos) is not int or eos < 0:
                    raise ConfigError(
                        f"{p}: eos_token_id {eos!r:.40} is not a token id; text calibration ends each "
                        "document with it: fix the file in the source and convert again"
                    )
                return eos
    return None


def load_tokenizer(hf_dir: str):
    """The checkpoint's own tokenizer.json, refused by name where it is missing or damaged."""
    tok_path = checkpoint_file(hf_dir, TOKENIZER)
    if not os.path.isfile(tok_path):
        raise ConfigError(
            f"{tok_path}: missing; text calibration data needs the checkpoint's tokenizer "
            "(or pass token ids as .npy / .safetensors)"
        )
    from tokenizers import Tokenizer

    data = read_bounded(tok_path, MAX_TOKENIZER_BYTES, "copy the model's tokenizer.json in again")
    try:
        return Tokenizer.from_str(data.decode("utf-8"))
    except Exception as e:  # the Rust library's one exception type for any file it cannot read
        raise ConfigError(
            f"{tok_path}: not a tokenizer the tokenizers library reads ({str(e)[:200]}); copy the "
            "model's tokenizer.json in again (or pass token ids as .npy / .safetensors)"
        ) from None


class Tokens(NamedTuple):
    ids: np.ndarray
    documents: int | None  # None: token ids
    truncated: int


def token_stream(path: str, hf_dir: str, need: int, column: str | None = None) -> Tokens:
    """The first `need` calibration tokens of one source in order (all of them where it holds
    fewer); documents joined by the end-of-sequence token. The data is read only as far as they
    reach."""
    if source_kind(path) in TOKEN_ID_KINDS:
        return Tokens(read_token_ids(path, need), None, 0)
    tok = load_tokenizer(hf_dir)
    eos = eos_id(hf_dir)
    pieces: list[list[int]] = []
    taken = text_tokens = truncated = 0
    for read in documents(path, hf_dir, column):
        doc_ids, cut = leading_tokens(tok, read, need - taken)
        text_tokens += len(doc_ids)
        truncated += cut
        pieces.append(doc_ids + ([eos] if eos is not None else []))
        taken += len(pieces[-1])
        if taken >= need:
            break
    if not text_tokens:  # only end-of-sequence tokens: calibrating on them measures nothing
        within = f" in its first {need} tokens" if taken >= need else ""
        raise ConfigError(
            f"{path}: holds no text to calibrate on{within}; give a file with text, or leave out "
            "--calib for the built-in corpus"
        )
    ids = np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=taken)[:need]
    return Tokens(ids, len(pieces), truncated)


def pack(stream: np.ndarray, num_samples: int, seq_len: int, vocab_size: int, source: str) -> torch.Tensor:
    """[num_samples, seq_len] consecutive windows of the stream; a short stream is reused from its start."""
    if stream.size == 0:
        raise ConfigError(f"{source}: no tokens")
    bad = (stream < 0) | (stream >= vocab_size)
    if bad.any():
        raise ConfigError(f"{source}: token id {int(stream[bad][0])} is outside the vocabulary [0, {vocab_size})")
    need = num_samples * seq_len
    if stream.size < need:
        if rank() == 0:  # every rank packs the same data; one of them says so
            logger().warning("%s: %d tokens for %d x %d; the data repeats", source, stream.size, num_samples, seq_len)
        stream = np.resize(stream, need)
    return torch.from_numpy(stream[:need].copy()).view(num_samples, seq_len)


def check_sizes(num_samples: int, seq_len: int) -> None:
    if num_samples < 1 or seq_len < 1:
        raise ConfigError(f"--calib-size {num_samples} and --seq-len {seq_len} must be positive")


class Calibration(NamedTuple):
    samples: torch.Tensor  # [num_samples, seq_len]
    held_out: torch.Tensor | None  # [held_out, seq_len], or None where none was asked for
    used: list[SourceUse]  # what each source gave


def read_calibration(
    calib: str | Sequence[str] | None,
    hf_dir: str,
    *,
    num_samples: int,
    seq_len: int,
    vocab_size: int,
    held_out: int = 0,
    column: str | None = None,
) -> Calibration:
    """The calibration sequences and, with `held_out`, that many more after them: each source gives
    its share of both, its calibration sequences first, its held-out ones after them (so holding
    out changes no calibration sequence); the sources' sequences follow in the order given. A
    source too short for its sequences repeats from its start (said once; its held-out windows
    then repeat calibration tokens)."""
    check_sizes(num_samples, seq_len)
    sources = check_sources(calib)
    shares = [s.share for s in sources]
    calib_parts, held_parts, used = [], [], []
    for s, n, h in zip(sources, split_counts(num_samples, shares), split_counts(held_out, shares)):
        use = SourceUse(s.path if s.path != BUILTIN else "built-in corpus", s.share, n, h)
        used.append(use)
        if n + h == 0:
            continue
        need = (n + h) * seq_len
        stream = token_stream(s.path, hf_dir, need, column)
        use.tokens, use.documents, use.truncated = int(stream.ids.size), stream.documents, stream.truncated
        use.repeated = stream.ids.size < need
        if n:
            calib_parts.append(pack(stream.ids, n, seq_len, vocab_size, s.path))
        ids = stream.ids
        if h and ids.size < need:
            if rank() == 0:
                logger().warning(
                    "%s: %d tokens for %d calibration and %d held-out sequences of %d; the held-out ones "
                    "repeat calibration tokens: give more data, or held-out data with --eval",
                    s.path,
                    ids.size,
                    n,
                    h,
                    seq_len,
                )
            ids = np.resize(ids, need)
        if h:
            held_parts.append(pack(ids[n * seq_len : need], h, seq_len, vocab_size, s.path))
    samples = torch.cat(calib_parts) if len(calib_parts) > 1 else calib_parts[0]
    held = (torch.cat(held_parts) if len(held_parts) > 1 else held_parts[0]) if held_out else None
    return Calibration(samples, held, used)


def calibration_samples(
    path: str | Sequence[str] | None,
    hf_dir: str,
    *,
    num_samples: int,
    seq_len: int,
    vocab_size: int,
    column: str | None = None,
) -> torch.Tensor:
    return read_calibration(
        path, hf_dir, num_samples=num_samples, seq_len=seq_len, vocab_size=vocab_size, column=column
    ).samples


def held_out_samples(
    path: str | Sequence[str] | None, hf_dir: str, *, num_samples: int, held_out: int, seq_len: int, vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the calibration sequences, `held_out` sequences after them): the first are exactly
    `calibration_samples`' (holding out changes no calibration statistic)."""
    if held_out < 1:
        raise ConfigError(f"--eval-size {held_out}: give a positive size, or 0 for no quality report")
    c = read_calibration(
        path, hf_dir, num_samples=num_samples, held_out=held_out, seq_len=seq_len, vocab_size=vocab_size
    )
    return c.samples, c.held_out
