"""Calibration sequences one document a row (truncated or padded) or packed, the documents in an order a
seed shuffles: each row is what the model's own tokenizer makes of its document."""

import json
import os

import pytest
from tokenizers import Tokenizer

from eprt.data import eos_id
from eprt.errors import ConfigError
from eprt.hf.convert import convert_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.samples import read_rows
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny

SEQ = 8


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    d = tmp_path_factory.mktemp("samples")
    hf = make_tiny("qwen3_moe", str(d / "hf"))
    tok = Tokenizer.from_file(os.path.join(hf, "tokenizer.json"))
    # every third document a word, shorter than SEQ tokens; the others longer
    texts = ["hello" if i % 3 == 0 else " ".join(f"word{i}x{j}" for j in range(3 + (7 * i) % 28)) for i in range(24)]
    path = d / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    ids = [tok.encode(t, add_special_tokens=False).ids for t in texts]
    return hf, str(path), ids


def rows_of(hf, path, n, **kw):
    return read_rows(path, hf, num_samples=n, seq_len=SEQ, vocab_size=10**6, **kw)


def test_truncate_makes_one_row_a_document_and_skips_the_short_ones(data):
    hf, path, ids = data
    c = rows_of(hf, path, 6, rows="truncate", held_out=2)
    long_ones = [x[:SEQ] for x in ids if len(x) >= SEQ]
    assert c.samples.tolist() == long_ones[:6] and c.held_out.tolist() == long_ones[6:8]
    read = next(i for i, x in enumerate(ids) if x[:SEQ] == long_ones[7]) + 1
    assert c.used[0].documents == read and c.used[0].sequences == 6 and c.used[0].held_out == 2


def test_pad_fills_a_short_document_with_the_end_of_sequence_token(data):
    hf, path, ids = data
    c = rows_of(hf, path, 8, rows="pad")
    eos = eos_id(hf)
    assert c.samples.tolist() == [(x + [eos] * SEQ)[:SEQ] for x in ids[:8]]
    assert any(len(x) < SEQ for x in ids[:8])  # some were padded


def test_a_seed_shuffles_the_documents_the_same_way_every_time(data):
    hf, path, ids = data
    a = rows_of(hf, path, 8, rows="pad", seed=3).samples.tolist()
    assert a == rows_of(hf, path, 8, rows="pad", seed=3).samples.tolist()
    assert a != rows_of(hf, path, 8, rows="pad", seed=4).samples.tolist()
    every = [(x + [eos_id(hf)] * SEQ)[:SEQ] for x in ids]
    assert all(row in every for row in a) and a != every[:8]  # documents of the file, not its first ones
    packed = rows_of(hf, path, 4, seed=3).samples.reshape(-1).tolist()
    first = every.index(a[0])  # packed with the same seed: the same order, end to end
    assert packed[: min(SEQ, len(ids[first]))] == ids[first][:SEQ]


def test_too_few_documents_for_a_row_each_is_refused_with_the_way_out(data):
    hf, path, ids = data
    with pytest.raises(
        ConfigError, match=r"docs.jsonl: \d+ documents make a sequence each \(\d+ shorter .*--calib-rows pad"
    ):
        rows_of(hf, path, len(ids), rows="truncate")
    with pytest.raises(ConfigError, match="--calib-rows 'rows': choose one of pack, truncate, pad"):
        rows_of(hf, path, 2, rows="rows")


def test_a_calibration_takes_its_rows_so(data, tmp_path):
    hf, path, ids = data
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False, reference=True)
    args = dict(calib=(path,), calib_size=4, seq_len=SEQ, eval_size=2, calib_rows="pad", seed=5, progress=False)
    run_ptq(ParallelState.single(), PTQArgs(ck, "fp8", str(tmp_path / "q"), **args))
    with Checkpoint(str(tmp_path / "q")) as q:
        (source,) = q.quantization["calibration"]["sources"]
    assert source["documents"] == 6 and source["sequences"] == 4 and source["held_out"] == 2
