"""Calibration sequences drawn from documents as the run asks (`--calib-rows`, `--seed`), beside
eprt.data, whose readers give the documents:

- `pack` (eprt.data's default): documents end to end, each ended by the end-of-sequence token, cut
  into sequences; a document may span two sequences;
- `truncate`: one document a sequence, cut at --seq-len; documents shorter than that are skipped;
- `pad`: one document a sequence, cut at --seq-len, a shorter one filled up with the
  end-of-sequence token after it.

With a seed, each source's documents are taken in an order shuffled by it (the same order on every
rank and at every layout), instead of the file's: a file sorted by topic then calibrates on all
its topics, not on its first ones. The documents are read whole to be shuffled, so a source is
held in memory once (calibration data is small beside a model).
"""

from __future__ import annotations

import random
from typing import NamedTuple, Sequence

import numpy as np
import torch

from eprt.calib_files import TOKEN_ID_KINDS, documents, source_kind
from eprt.data import (
    BUILTIN,
    Calibration,
    SourceUse,
    check_sizes,
    check_sources,
    eos_id,
    leading_tokens,
    load_tokenizer,
    pack,
    split_counts,
)
from eprt.errors import ConfigError
from eprt.progress import logger, rank
from eprt.quant.run.args import ROWS


def read_rows(
    calib: str | Sequence[str] | None,
    hf_dir: str,
    *,
    num_samples: int,
    seq_len: int,
    vocab_size: int,
    rows: str = "pack",
    seed: int | None = None,
    held_out: int = 0,
    column: str | None = None,
) -> Calibration:
    """eprt.data.read_calibration's sequences, with the documents taken as `rows` says, in an
    order shuffled by `seed`: each source gives its share of the calibration sequences, then of the
    held-out ones after them."""
    if rows not in ROWS:
        raise ConfigError(f"--calib-rows {rows!r}: choose one of {', '.join(ROWS)}")
    check_sizes(num_samples, seq_len)
    sources = check_sources(calib)
    shares = [s.share for s in sources]
    tok = load_tokenizer(hf_dir)
    eos = eos_id(hf_dir)
    calib_parts, held_parts, used = [], [], []
    for s, n, h in zip(sources, split_counts(num_samples, shares), split_counts(held_out, shares)):
        name = s.path if s.path != BUILTIN else "built-in corpus"
        use = SourceUse(name, s.share, n, h)
        used.append(use)
        if n + h == 0:
            continue
        if source_kind(s.path) in TOKEN_ID_KINDS:
            raise ConfigError(f"--calib {s.path}: token ids hold no documents to draw rows or shuffle from")
        docs = list(documents(s.path, hf_dir, column))
        order = list(range(len(docs)))
        if seed is not None:
            random.Random(seed).shuffle(order)
        taken = take(tok, [docs[i] for i in order], n + h, seq_len, rows, eos, name)
        use.documents, use.truncated = taken.documents, taken.truncated
        use.tokens = int(taken.ids.size)
        if rank() == 0:
            logger().info(
                "%s: %d of its %d documents%s, %s",
                name,
                taken.documents,
                len(docs),
                f" (shuffled with seed {seed})" if seed is not None else "",
                describe(rows, seq_len, taken),
            )
        use.repeated = taken.ids.size < (n + h) * seq_len  # packed only: one a row refuses too few documents
        block = pack(taken.ids, n + h, seq_len, vocab_size, s.path)
        calib_parts.append(block[:n])
        held_parts.append(block[n:])
    samples = torch.cat(calib_parts)
    held = torch.cat(held_parts) if held_out else None
    return Calibration(samples, held, used)


class Taken(NamedTuple):
    ids: np.ndarray
    documents: int  # documents read
    truncated: int  # of them, cut short
    skipped: int  # of them, too short for a row of their own (truncate)


def take(tok, docs: list, count: int, seq_len: int, rows: str, eos: int | None, name: str) -> Taken:
    """The token ids of `count` sequences of `seq_len` from `docs` in order: packed end to end (a
    short stream is repeated by eprt.data.pack), or one document a row."""
    pieces: list[list[int]] = []
    taken = truncated = skipped = 0
    need = count * seq_len
    for read in docs:
        if rows == "pack":
            ids, cut = leading_tokens(tok, read, need - taken)
            pieces.append(ids + ([eos] if eos is not None else []))
            taken += len(pieces[-1])
            truncated += cut
            if taken >= need:
                break
            continue
        ids, cut = leading_tokens(tok, read, seq_len)
        if len(ids) < seq_len:
            if rows == "truncate" or not ids:
                skipped += 1
                continue
            ids = ids + [eos if eos is not None else ids[-1]] * (seq_len - len(ids))
        pieces.append(ids)
        truncated += cut
        if len(pieces) == count:
            break
    if rows != "pack" and len(pieces) < count:
        shorter = f" ({skipped} shorter than {seq_len} tokens, skipped)" if rows == "truncate" else ""
        raise ConfigError(
            f"{name}: {len(pieces)} documents make a sequence each{shorter}, but {count} sequences are needed: "
            f"give more data, fewer sequences (--calib-size, --eval-size), or --calib-rows "
            f"{'pad' if rows == 'truncate' else 'pack'}"
        )
    flat = [t for p in pieces for t in p][:need]
    return Taken(np.asarray(flat, dtype=np.int64), len(pieces) + (skipped if rows != "pack" else 0), truncated, skipped)


def describe(rows: str, seq_len: int, taken: Taken) -> str:
    if rows == "pack":
        return f"packed end to end ({taken.truncated} cut short)"
    if rows == "truncate":
        return f"one a sequence, cut at {seq_len} tokens ({taken.truncated} cut, {taken.skipped} shorter skipped)"
    return f"one a sequence, cut at {seq_len} tokens or padded to it ({taken.truncated} cut)"


def first_sample(calib: Sequence[str], hf_dir: str, column: str | None = None, chars: int = 400) -> str | None:
    """The first `chars` characters of the first --calib source's first document as the model reads
    it (a conversation rendered by its chat template, refused here where it has none); None for
    token ids."""
    path = check_sources(list(calib))[0].path
    if source_kind(path) in TOKEN_ID_KINDS:
        return None
    first = next(documents(path, hf_dir, column), None)
    return None if first is None else first(chars)
