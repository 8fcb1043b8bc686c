"""Calibration data as users hold it: chat conversations through the checkpoint's own template,
Parquet files and saved datasets, several sources mixed by share; each refusal names its culprit."""

import json
import os
import shutil
import sys

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from eprt.data import parse_sources, read_calibration, split_counts
from eprt.errors import ConfigError
from eprt.testing.tiny import TINY_DIR

CHATS = [
    [
        {"role": "user", "content": "Where do the tokens go?"},
        {"role": "assistant", "content": "To the rank that holds their expert."},
    ],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why calibrate?"}],
]
TEXTS = ["The river ran low in late summer.", "Tokens travel to the rank that holds their expert."]
EOS = 0  # the tiny generation_config's eos_token_id


def chatml(messages) -> str:
    """The tiny model's template, written out by hand: ChatML."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


def stream_of(texts) -> list[int]:
    tok = Tokenizer.from_file(os.path.join(TINY_DIR, "tokenizer.json"))
    return [i for t in texts for i in tok.encode(t, add_special_tokens=False).ids + [EOS]]


def read(calib, hf_dir=TINY_DIR, n=2, t=8, **kw):
    return read_calibration(calib, hf_dir, num_samples=n, seq_len=t, vocab_size=512, **kw)


def expected(texts, n=2, t=8) -> torch.Tensor:
    return torch.from_numpy(np.resize(np.array(stream_of(texts)), n * t)).view(n, t)


def test_chat_messages_are_rendered_with_the_checkpoints_template(tmp_path):
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CHATS))
    got = read(str(path), n=5, t=16)
    rendered = [chatml(m) for m in CHATS]
    assert torch.equal(got.samples, expected(rendered, 5, 16))
    # the special tokens of the template are the tokenizer's own ids, not their characters spelt out
    assert Tokenizer.from_file(os.path.join(TINY_DIR, "tokenizer.json")).token_to_id("<|im_start|>") in got.samples
    used = got.used[0].to_json()
    assert used == {
        "path": str(path),
        "share": 1.0,
        "sequences": 5,
        "held_out": 0,
        "tokens": len(stream_of(rendered)),
        "documents": 2,
        "truncated": 0,
        "repeated": True,
    }


def test_chat_template_jinja_file_wins_over_tokenizer_config(tmp_path):
    hf = shutil.copytree(TINY_DIR, tmp_path / "hf")
    (hf / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}")
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    got = read(str(tmp_path / "chat.jsonl"), str(hf), n=1, t=4)
    assert torch.equal(got.samples, expected(["".join(f"[{m['role']}] {m['content']}\n" for m in CHATS[0])], 1, 4))


def no_template_dir(tmp_path):
    hf = shutil.copytree(TINY_DIR, tmp_path / "hf")
    config = json.loads((hf / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (hf / "tokenizer_config.json").write_text(json.dumps(config))
    return hf


def test_a_checkpoint_without_a_chat_template_is_refused_naming_the_way_out(tmp_path):
    hf = no_template_dir(tmp_path)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    with pytest.raises(
        ConfigError,
        match=r"chat\.jsonl: holds chat messages, but the checkpoint has no chat template"
        r".*convert again, or calibrate on plain text",
    ):
        read(str(tmp_path / "chat.jsonl"), str(hf))
    (tmp_path / "text.jsonl").write_text(json.dumps({"text": TEXTS[0]}) + "\n")  # plain text needs none
    assert read(str(tmp_path / "text.jsonl"), str(hf)).samples.shape == (2, 8)


@pytest.mark.parametrize(
    "template, reached",
    [
        ("{{ messages.__class__.__mro__ }}", "__class__"),
        ("{{ ''.__class__.__base__.__subclasses__() }}", "__class__"),
        ("{{ lipsum.__globals__['os'] }}", "__globals__"),
        ("{% set x = messages.append(1) %}{{ x }}", "append"),
        ("{{ raise_exception.__globals__ }}", "__globals__"),
    ],
)
def test_a_template_reaching_for_python_is_refused_by_name(tmp_path, template, reached):
    hf = no_template_dir(tmp_path)
    (hf / "chat_template.jinja").write_text(template)
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    with pytest.raises(
        ConfigError,
        match=rf"chat_template\.jinja: the chat template tried to reach Python \(.*"
        rf"{reached}.*chat\.jsonl:1",
    ):
        read(str(tmp_path / "chat.jsonl"), str(hf))


def test_a_template_rendering_without_bound_is_stopped(tmp_path, monkeypatch):
    import eprt.storage.chat_template as chat_template

    monkeypatch.setattr(chat_template, "MAX_RENDERED_CHARS", 10_000)
    hf = no_template_dir(tmp_path)
    (hf / "chat_template.jinja").write_text(
        "{% for i in range(99999) %}{% for j in range(99999) %}xx{% endfor %}{% endfor %}"
    )
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": CHATS[0]}) + "\n")
    with pytest.raises(ConfigError, match=r"chat\.jsonl:1: the chat template of .* renders more than 10000"):
        read(str(tmp_path / "chat.jsonl"), str(hf))


@pytest.mark.parametrize(
    "row, message",
    [
        ({"messages": {"role": "user", "content": "hi"}}, r"c\.jsonl:1: holds a dict, neither text"),
        ({"messages": [{"content": "no role"}]}, r"c\.jsonl:1: holds a list, neither text"),
        ({"text": 3}, r"c\.jsonl:1: holds a int, neither text"),
    ],
)
def test_a_row_that_is_neither_text_nor_a_conversation_is_named(tmp_path, row, message):
    (tmp_path / "c.jsonl").write_text(json.dumps(row) + "\n")
    with pytest.raises(ConfigError, match=message):
        read(str(tmp_path / "c.jsonl"))


# --- tables ---------------------------------------------------------------------------------------


def test_parquet_text_and_messages_columns_read_as_jsonl_does(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    pq.write_table(pa.table({"text": TEXTS, "id": [1, 2]}), tmp_path / "t.parquet", row_group_size=1)
    assert torch.equal(read(str(tmp_path / "t.parquet")).samples, expected(TEXTS))
    pq.write_table(pa.table({"messages": CHATS}), tmp_path / "m.parquet")
    chats = expected([chatml(m) for m in CHATS], 3, 16)
    assert torch.equal(read(str(tmp_path / "m.parquet"), n=3, t=16).samples, chats)
    pq.write_table(pa.table({"prompt": TEXTS}), tmp_path / "p.parquet")
    assert torch.equal(read(str(tmp_path / "p.parquet"), column="prompt").samples, expected(TEXTS))
    with pytest.raises(
        ConfigError,
        match=r"p\.parquet: no column 'text'; its columns are prompt: name one with "
        r"--calib-column",
    ):
        read(str(tmp_path / "p.parquet"))


def test_a_saved_dataset_reads_as_jsonl_does(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": TEXTS}).save_to_disk(str(tmp_path / "ds"))
    got = read(str(tmp_path / "ds"))
    assert torch.equal(got.samples, expected(TEXTS)) and got.used[0].documents == 2
    datasets.DatasetDict(
        {
            "train": datasets.Dataset.from_dict({"messages": CHATS}),
            "test": datasets.Dataset.from_dict({"messages": CHATS[:1]}),
        }
    ).save_to_disk(str(tmp_path / "dd"))
    assert torch.equal(read(str(tmp_path / "dd"), n=3, t=16).samples, expected([chatml(m) for m in CHATS], 3, 16))
    with pytest.raises(ConfigError, match=r"ds: no column 'body'; its columns are text"):
        read(str(tmp_path / "ds"), column="body")


def test_a_table_without_its_library_names_the_extra_to_install(tmp_path, monkeypatch):
    (tmp_path / "t.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # as if not installed
    with pytest.raises(
        ConfigError,
        match=r"t\.parquet: reading Parquet needs the pyarrow library: pip install "
        r"\"eprt\[data\]\"",
    ):
        read(str(tmp_path / "t.parquet"))


def test_files_that_are_not_what_their_name_says_are_refused(tmp_path):
    pytest.importorskip("pyarrow")
    (tmp_path / "fake.parquet").write_text("a,b\n1,2\n")
    with pytest.raises(ConfigError, match=r"fake\.parquet: not a Parquet file"):
        read(str(tmp_path / "fake.parquet"))
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.txt").write_text("text")
    with pytest.raises(
        ConfigError,
        match=r"--calib .*dir: a directory, but not a dataset saved with the datasets "
        r"library's save_to_disk",
    ):
        read(str(tmp_path / "dir"))


# --- several sources ------------------------------------------------------------------------------


def test_sources_give_their_share_of_sequences_and_held_out_ones_and_record_it(tmp_path):
    (tmp_path / "a.txt").write_text(TEXTS[0] * 20)
    (tmp_path / "b.jsonl").write_text(json.dumps({"text": TEXTS[1]}) + "\n")
    a, b = str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")
    got = read([f"{a}:0.75", f"{b}:0.25"], n=8, t=8, held_out=8)
    alone_a = read(a, n=6, t=8, held_out=6)
    alone_b = read(b, n=2, t=8, held_out=2)
    # each source's sequences are those it gives alone, in the order the sources were given
    assert torch.equal(got.samples, torch.cat([alone_a.samples, alone_b.samples]))
    assert torch.equal(got.held_out, torch.cat([alone_a.held_out, alone_b.held_out]))
    assert [(u.path, u.share, u.sequences, u.held_out) for u in got.used] == [(a, 0.75, 6, 6), (b, 0.25, 2, 2)]
    assert got.used[0].truncated == 1 and not got.used[0].repeated  # a.txt holds more than its 96 tokens
    assert got.used[1].repeated and got.used[1].tokens == len(stream_of(TEXTS[1:]))


def test_split_counts_is_exact_and_deterministic():
    assert split_counts(10, [0.7, 0.3]) == [7, 3]
    assert split_counts(3, [0.5, 0.5]) == [2, 1]  # a tie goes to the first source
    assert split_counts(7, [1 / 3] * 3) == [3, 2, 2]
    assert sum(split_counts(1001, [0.123, 0.456, 0.421])) == 1001


@pytest.mark.parametrize(
    "specs, message",
    [
        (["a.txt", "b.txt:0.5"], r"--calib a\.txt: with several --calib, give each its share"),
        (["a.txt:0.5", "b.txt:0.4"], r"--calib shares sum to 0\.9; they are fractions of the sequences and sum to 1"),
        (["a.txt:1.5", "b.txt:-0.5"], r"--calib a\.txt:1\.5: a share is a fraction in \(0, 1\]"),
    ],
)
def test_shares_that_do_not_make_a_whole_are_refused(specs, message):
    with pytest.raises(ConfigError, match=message):
        parse_sources(specs)


def test_a_colon_in_a_path_is_part_of_the_path():
    assert [(s.path, s.share) for s in parse_sources("data:v2/c.txt")] == [("data:v2/c.txt", 1.0)]
    assert [(s.path, s.share) for s in parse_sources(["x:y.txt:0.5", "z.txt:0.5"])] == [
        ("x:y.txt", 0.5),
        ("z.txt", 0.5),
    ]


def test_the_command_line_takes_several_sources_and_a_column():
    from eprt.commands.ptq import parse_args

    a, _ = parse_args(["ck", "--calib", "chat.jsonl:0.7", "--calib", "code.txt:0.3", "--calib-column", "body"])
    assert a.calib == ("chat.jsonl:0.7", "code.txt:0.3") and a.calib_column == "body"
    assert [(s.path, s.share) for s in parse_sources(a.calib)] == [("chat.jsonl", 0.7), ("code.txt", 0.3)]
