"""Calibration data: text, JSONL, chat conversations, tables or token ids, packed into sequences.

A source is a file or a saved dataset; several may be given, each with its share of the
sequences (`--calib chat.jsonl:0.7 --calib code.txt:0.3`). The global list of sequences depends
only on the data and (num_samples, seq_len); the layer-major engine gives each rank every
world-th sequence of it (eprt.quant.loop.sequences.own_sequences), so the set calibrated is the same at
every layout. What was taken of each source is recorded (`SourceUse`): the calibrated checkpoint
and the quality report keep it.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import NamedTuple

import numpy as np
import torch

from eprt.calib_files import TOKEN_ID_KINDS, documents, read_token_ids, source_kind
from eprt.errors import ConfigError
from eprt.progress import logger, rank
from eprt.storage.bounded import read_bounded, read_json
from eprt.storage.chat_template import checkpoint_file
from eprt.storage.hf_files import CONFIG, GENERATION_CONFIG, TOKENIZER
from eprt.storage.tables import is_saved_dataset

BUILTIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "calib.txt")
MAX_TOKENIZER_BYTES = 256 << 20  # released tokenizer.json files are a few MiB to a few tens


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
