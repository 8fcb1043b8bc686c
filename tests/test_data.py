"""Calibration data: every source gives the same tokens, and the set calibrated does not depend on the layout."""

import json
import os

import numpy as np
import pytest
import torch
from safetensors.numpy import save_file
from tokenizers import Tokenizer

from eprt.data import calibration_samples
from eprt.errors import ConfigError
from eprt.testing.tiny import TINY_DIR

TEXTS = ["The river ran low in late summer.", "Tokens travel to the rank that holds their expert."]


def expected_stream():
    tok = Tokenizer.from_file(os.path.join(TINY_DIR, "tokenizer.json"))
    ids = []
    for t in TEXTS:
        ids += tok.encode(t, add_special_tokens=False).ids + [0]  # eos_token_id 0 in the tiny generation_config
    return np.array(ids)


def samples(path, n=3, t=8):
    return calibration_samples(str(path), TINY_DIR, num_samples=n, seq_len=t, vocab_size=512)


def test_jsonl_text_npy_and_safetensors_agree(tmp_path):
    stream = expected_stream()
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"text": t}) for t in TEXTS) + "\n")
    np.save(tmp_path / "c.npy", stream)
    save_file({"input_ids": stream.astype(np.int32)}, str(tmp_path / "c.safetensors"))
    want = torch.from_numpy(np.resize(stream, 24)).view(3, 8)
    for name in ("c.jsonl", "c.npy", "c.safetensors"):
        assert torch.equal(samples(tmp_path / name), want), name
    (tmp_path / "c.txt").write_text(TEXTS[0])
    assert samples(tmp_path / "c.txt", 1, 4).tolist()[0] == list(stream[:4])


def test_builtin_corpus_serves_the_demo():
    s = calibration_samples(None, TINY_DIR, num_samples=8, seq_len=32, vocab_size=512)
    assert s.shape == (8, 32) and len(set(s.view(-1).tolist())) > 50


@pytest.mark.parametrize(
    "content,message",
    [
        ('{"text": "a"}\nnot json\n', r"c\.jsonl:2: not valid JSON"),
        ('{"txt": "a"}\n', r"c\.jsonl:1: each line needs a string field \"text\""),
    ],
)
def test_bad_jsonl_names_the_line(tmp_path, content, message):
    (tmp_path / "c.jsonl").write_text(content)
    with pytest.raises(ConfigError, match=message):
        samples(tmp_path / "c.jsonl")


def test_token_ids_outside_the_vocabulary_are_refused(tmp_path):
    np.save(tmp_path / "c.npy", np.array([1, 2, 700]))
    with pytest.raises(ConfigError, match=r"token id 700 is outside the vocabulary \[0, 512\)"):
        samples(tmp_path / "c.npy")
