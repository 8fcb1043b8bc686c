"""Calibration data: text, JSONL or token ids, packed into sequences.

The global list of sequences depends only on the data and (num_samples, seq_len); the layer-major
engine gives each rank every world-th sequence of it (eprt.quant.engine.own_sequences), so the
set calibrated is the same at every layout.
"""

from __future__ import annotations

import codecs
import itertools
import math
import os
from collections.abc import Callable, Iterator

import numpy as np
import torch

from eprt.errors import CheckpointError, ConfigError
from eprt.progress import logger, rank
from eprt.storage.bounded import parse_json, read_json
from eprt.storage.hf_files import CONFIG, GENERATION_CONFIG, TOKENIZER
from eprt.storage.safetensors_io import SafetensorsFile

BUILTIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "calib.txt")


# A document is tokenized a prefix at a time: the first holds this many characters, plus this
# many a token needed (about four times what a token spans in English text).
FIRST_CHARS = 4096
CHARS_PER_TOKEN = 16


def documents(path: str) -> Iterator[Callable[[int], str]]:
    """Each document of a .txt file (the whole file) or a .jsonl file (one {"text": ...} a line),
    as a reader giving the next n characters of its text ('' at its end). The file is read as
    far as its documents are asked for."""
    with open(path, "rb") as f:
        if not path.endswith(".jsonl"):
            yield utf8_reader(f, path)
            return
        offset = 0
        for i, raw in enumerate(f, 1):
            line = decode_utf8(raw, path, offset)
            offset += len(raw)
            if not line.strip():
                continue
            row = parse_json(line, f"{path}:{i}", "each line is one JSON object {\"text\": ...}")
            if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                raise ConfigError(f"{path}:{i}: each line needs a string field \"text\"")
            yield text_reader(row["text"])


def text_reader(text: str) -> Callable[[int], str]:
    """`text`, n characters at a time (io.StringIO would copy it four bytes a character)."""
    at = 0

    def read(n: int) -> str:
        nonlocal at
        piece = text[at:at + n]
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
    return ConfigError(f"{path}: not UTF-8 text (byte {byte}); calibration text is UTF-8 "
                       "(.txt, or .jsonl with one {\"text\": ...} per line)")


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


def leading_tokens(tok, read: Callable[[int], str], need: int) -> list[int]:
    """The first `need` tokens of the document `read` gives (all of them where it has fewer),
    tokenizing a few times the text they span, never the whole of a long document.

    A prefix of a text tokenizes as the whole text does except near the cut, where a word (or a
    merge) may go on past it: the first `need` tokens of a prefix are taken once they are more
    than `need` and a prefix twice as long begins with the same ones."""
    text = read(FIRST_CHARS + need * CHARS_PER_TOKEN)
    ids = tok.encode(text, add_special_tokens=False).ids
    while True:
        more = read(len(text))
        if not more:
            return ids[:need]
        text += more
        longer = tok.encode(text, add_special_tokens=False).ids
        if len(ids) > need and longer[:need] == ids[:need]:
            return ids[:need]
        ids = longer


def read_token_ids(path: str, need: int) -> np.ndarray:
    """The first `need` token ids (row-major) of a .npy file (any integer array) or a .safetensors
    file (tensor `input_ids`, or its only tensor), reading only the rows that hold them."""
    ids = npy_token_ids(path) if path.endswith(".npy") else safetensors_token_ids(path, need)
    if not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"{path}: token ids must be integers, found {ids.dtype}")
    if ids.ndim > 1:  # the rows holding the first `need` ids, never the array
        row = math.prod(ids.shape[1:])
        ids = ids[:-(-need // row) if row else 0]
    return np.array(ids.reshape(-1)[:need], dtype=np.int64)


def npy_token_ids(path: str) -> np.ndarray:
    """The array of a .npy file, mapped (nothing read until used), its declared size checked
    against the bytes the file holds."""
    not_npy = f"{path}: not a NumPy .npy array of token ids"
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read_header = {(1, 0): np.lib.format.read_array_header_1_0,
                           (2, 0): np.lib.format.read_array_header_2_0}.get(version)
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
        raise ConfigError(f"{path}: declares {count} token ids of shape {list(shape)} but holds {held} bytes of "
                          f"data ({held // dtype.itemsize} ids): the file is truncated or damaged; save it again")
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
        p = os.path.join(hf_dir, name)
        if os.path.isfile(p):
            cfg = read_json(p, "text calibration reads the end-of-sequence token there: fix the file in the source "
                               "and convert again")
            eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                if type(eos) is not int or eos < 0:
                    raise ConfigError(f"{p}: eos_token_id {eos!r:.40} is not a token id; text calibration ends each "
                                      "document with it: fix the file in the source and convert again")
                return eos
    return None


def load_tokenizer(hf_dir: str):
    """The checkpoint's own tokenizer.json, refused by name where it is missing or damaged."""
    tok_path = os.path.join(hf_dir, TOKENIZER)
    if not os.path.isfile(tok_path):
        raise ConfigError(f"{tok_path}: missing; text calibration data needs the checkpoint's tokenizer "
                          "(or pass token ids as .npy / .safetensors)")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(tok_path)
    except Exception as e:  # the Rust library's one exception type for any file it cannot read
        raise ConfigError(f"{tok_path}: not a tokenizer the tokenizers library reads ({str(e)[:200]}); copy the "
                          "model's tokenizer.json in again (or pass token ids as .npy / .safetensors)") from None


def token_stream(path: str | None, hf_dir: str, need: int) -> np.ndarray:
    """The first `need` calibration tokens in order (all of them where the data holds fewer);
    documents joined by the end-of-sequence token. The data is read only as far as they reach."""
    path = path or BUILTIN
    if not os.path.isfile(path):
        raise ConfigError(f"--calib {path}: no such file")
    if path.endswith((".npy", ".safetensors")):
        return read_token_ids(path, need)
    tok = load_tokenizer(hf_dir)
    eos = eos_id(hf_dir)
    pieces: list[list[int]] = []
    taken = text_tokens = 0
    for read in documents(path):
        doc_ids = leading_tokens(tok, read, need - taken)
        text_tokens += len(doc_ids)
        pieces.append(doc_ids + ([eos] if eos is not None else []))
        taken += len(pieces[-1])
        if taken >= need:
            break
    if not text_tokens:  # only end-of-sequence tokens: calibrating on them measures nothing
        within = f" in its first {need} tokens" if taken >= need else ""
        raise ConfigError(f"{path}: holds no text to calibrate on{within}; give a file with text, or leave out "
                          "--calib for the built-in corpus")
    return np.fromiter(itertools.chain.from_iterable(pieces), dtype=np.int64, count=taken)[:need]


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
            logger().warning("%s: %d tokens for %d x %d; the data repeats", source, stream.size, num_samples,
                             seq_len)
        stream = np.resize(stream, need)
    return torch.from_numpy(stream[:need].copy()).view(num_samples, seq_len)


def check_sizes(num_samples: int, seq_len: int) -> None:
    if num_samples < 1 or seq_len < 1:
        raise ConfigError(f"--calib-size {num_samples} and --seq-len {seq_len} must be positive")


def calibration_samples(path: str | None, hf_dir: str, *, num_samples: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    check_sizes(num_samples, seq_len)
    return pack(token_stream(path, hf_dir, num_samples * seq_len), num_samples, seq_len, vocab_size, path or BUILTIN)


def held_out_samples(path: str | None, hf_dir: str, *, num_samples: int, held_out: int, seq_len: int,
                     vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the calibration sequences, `held_out` sequences after them): the first are exactly
    `calibration_samples`' (holding out changes no calibration statistic). A stream too short
    for both repeats from its start, so the held-out windows then repeat calibration tokens:
    said once."""
    check_sizes(num_samples, seq_len)
    if held_out < 1:
        raise ConfigError(f"--eval-size {held_out}: give a positive size, or 0 for no quality report")
    stream = token_stream(path, hf_dir, (num_samples + held_out) * seq_len)
    source = path or BUILTIN
    calib = pack(stream, num_samples, seq_len, vocab_size, source)
    need = (num_samples + held_out) * seq_len
    if stream.size < need:
        if rank() == 0:
            logger().warning("%s: %d tokens for %d calibration and %d held-out sequences of %d; the held-out ones "
                             "repeat calibration tokens: give more data, or held-out data with --eval",
                             source, stream.size, num_samples, held_out, seq_len)
        stream = np.resize(stream, need)
    return calib, pack(stream[num_samples * seq_len:need], held_out, seq_len, vocab_size, source)
