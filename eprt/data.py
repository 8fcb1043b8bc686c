"""Calibration data: text, JSONL or token ids, packed into sequences, split over ranks.

The global list of sequences depends only on the data and (num_samples, seq_len); each rank
takes every world-th sequence of it, so the set calibrated is the same at every layout.
"""

from __future__ import annotations

import json
import os

import numpy as np
import torch

from eprt.errors import ConfigError
from eprt.progress import logger, rank
from eprt.storage.hf_files import CONFIG, GENERATION_CONFIG, TOKENIZER

BUILTIN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "calib.txt")


def read_documents(path: str) -> list[str]:
    """Text of a .txt file (one document) or of a .jsonl file (one {"text": ...} per line)."""
    try:
        return read_text(path)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start}); calibration text is UTF-8 "
                          "(.txt, or .jsonl with one {\"text\": ...} per line)") from None


def read_text(path: str) -> list[str]:
    if path.endswith(".jsonl"):
        docs = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"{path}:{i}: not JSON ({e})") from None
                if not isinstance(row, dict) or not isinstance(row.get("text"), str):
                    raise ConfigError(f"{path}:{i}: each line needs a string field \"text\"")
                docs.append(row["text"])
        return docs
    with open(path, encoding="utf-8") as f:
        return [f.read()]


def read_token_ids(path: str) -> np.ndarray:
    """Token ids from .npy (any integer array) or .safetensors (tensor `input_ids`, or its only tensor)."""
    if path.endswith(".npy"):
        try:
            ids = np.load(path, allow_pickle=False)
        except (ValueError, OSError, EOFError) as e:
            raise ConfigError(f"{path}: not a NumPy .npy array of token ids ({e})") from None
    else:
        from safetensors import SafetensorError
        from safetensors.numpy import load_file

        try:
            tensors = load_file(path)
        except (SafetensorError, ValueError, TypeError) as e:
            raise ConfigError(f"{path}: not a safetensors file of token ids ({e})") from None
        if "input_ids" not in tensors and len(tensors) != 1:
            raise ConfigError(f"{path}: holds {sorted(tensors)}; name the token ids `input_ids`")
        ids = tensors.get("input_ids", next(iter(tensors.values())))
    if not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"{path}: token ids must be integers, found {ids.dtype}")
    return ids.reshape(-1).astype(np.int64)


def eos_id(hf_dir: str) -> int | None:
    for name in (GENERATION_CONFIG, CONFIG):
        p = os.path.join(hf_dir, name)
        if os.path.isfile(p):
            try:
                with open(p, encoding="utf-8") as f:
                    cfg = json.load(f)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise ConfigError(f"{p}: not UTF-8 JSON ({e}); text calibration reads the end-of-sequence "
                                  "token there: fix the file in the source and convert again") from None
            eos = cfg.get("eos_token_id") if isinstance(cfg, dict) else None
            if isinstance(eos, list):
                eos = eos[0] if eos else None
            if eos is not None:
                return int(eos)
    return None


def token_stream(path: str | None, hf_dir: str) -> np.ndarray:
    """All calibration tokens in order; documents joined by the end-of-sequence token."""
    path = path or BUILTIN
    if not os.path.isfile(path):
        raise ConfigError(f"--calib {path}: no such file")
    if path.endswith((".npy", ".safetensors")):
        return read_token_ids(path)
    tok_path = os.path.join(hf_dir, TOKENIZER)
    if not os.path.isfile(tok_path):
        raise ConfigError(f"{tok_path}: missing; text calibration data needs the checkpoint's tokenizer "
                          "(or pass token ids as .npy / .safetensors)")
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(tok_path)
    eos = eos_id(hf_dir)
    ids: list[int] = []
    text_tokens = 0
    for doc in read_documents(path):
        doc_ids = tok.encode(doc, add_special_tokens=False).ids
        text_tokens += len(doc_ids)
        ids += doc_ids
        if eos is not None:
            ids.append(eos)
    if not text_tokens:  # only end-of-sequence tokens: calibrating on them measures nothing
        raise ConfigError(f"{path}: holds no text to calibrate on; give a file with text, or leave out --calib "
                          "for the built-in corpus")
    return np.asarray(ids, dtype=np.int64)


def pack(stream: np.ndarray, num_samples: int, seq_len: int, vocab_size: int, source: str) -> torch.Tensor:
    """[num_samples, seq_len] consecutive windows of the stream; a short stream is reused from its start."""
    if num_samples < 1 or seq_len < 1:
        raise ConfigError(f"--calib-size {num_samples} and --seq-len {seq_len} must be positive")
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


def calibration_samples(path: str | None, hf_dir: str, *, num_samples: int, seq_len: int, vocab_size: int) -> torch.Tensor:
    return pack(token_stream(path, hf_dir), num_samples, seq_len, vocab_size, path or BUILTIN)


def held_out_samples(path: str | None, hf_dir: str, *, num_samples: int, held_out: int, seq_len: int,
                     vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(the calibration sequences, `held_out` sequences after them): the first are exactly
    `calibration_samples`' (holding out changes no calibration statistic). A stream too short
    for both repeats from its start, so the held-out windows then repeat calibration tokens:
    said once."""
    stream = token_stream(path, hf_dir)
    source = path or BUILTIN
    calib = pack(stream, num_samples, seq_len, vocab_size, source)
    if held_out < 1:
        raise ConfigError(f"--eval-size {held_out}: give a positive size, or 0 for no quality report")
    need = (num_samples + held_out) * seq_len
    if stream.size < need:
        if rank() == 0:
            logger().warning("%s: %d tokens for %d calibration and %d held-out sequences of %d; the held-out ones "
                             "repeat calibration tokens: give more data, or held-out data with --eval",
                             source, stream.size, num_samples, held_out, seq_len)
        stream = np.resize(stream, need)
    return calib, pack(stream[num_samples * seq_len:need], held_out, seq_len, vocab_size, source)


def rank_batches(samples: torch.Tensor, rank: int, world: int, batch_size: int) -> list[torch.Tensor]:
    """This rank's share (sequences rank, rank + world, ...) in batches of at most `batch_size`.

    Every rank gets the same number of batches, some possibly empty, because every batch is a
    step in which all ranks exchange tokens.
    """
    if batch_size < 1:
        raise ConfigError(f"--batch-size {batch_size} must be positive")
    mine = samples[rank::world]
    steps = -(-(-(-samples.shape[0] // world)) // batch_size)
    return [mine[i * batch_size:(i + 1) * batch_size] for i in range(steps)]
