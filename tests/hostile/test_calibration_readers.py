"""Calibration readers are bounded by what they need: a line or a table cell is measured before it
is decoded, only regular files are read (a FIFO is refused, never waited on), a chat template
renders under a time and a size limit, a format is recognised by its content as well as its suffix,
and message content that is not text is refused by name. The checkpoint's template and tokenizer,
and a saved dataset's files, are read only inside their directories."""

import json
import os
import shutil
import threading

import numpy as np
import pytest
import torch

from eprt import calib_files
from eprt.data import read_calibration
from eprt.errors import EprtError
from eprt.storage import tables, template_bounds
from eprt.testing.tiny import TINY_DIR

CHATS = [
    [
        {"role": "user", "content": "Where do the tokens go?"},
        {"role": "assistant", "content": "To the rank that holds their expert."},
    ],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Why calibrate?"}],
]


def read(calib, hf_dir=TINY_DIR, n=2, t=8):
    return read_calibration(str(calib), str(hf_dir), num_samples=n, seq_len=t, vocab_size=512).samples


def refused(calib, hf_dir=TINY_DIR, timeout=20) -> str:
    """The refusal reading `calib` ends in, within `timeout` seconds (a read that blocks fails)."""
    outcome = []

    def attempt():
        try:
            read(calib, hf_dir)
            outcome.append(None)
        except EprtError as e:
            outcome.append(str(e))

    t = threading.Thread(target=attempt, daemon=True)
    t.start()
    t.join(timeout)
    assert outcome, f"reading {calib} did not end within {timeout} s"
    assert outcome[0] is not None, f"{calib} was read"
    return outcome[0]


@pytest.fixture
def ckpt(tmp_path):
    """A copy of the tiny checkpoint's non-weight files (tokenizer, chat template), to edit."""
    return shutil.copytree(TINY_DIR, tmp_path / "ck")


def with_template(ckpt, source: str):
    (ckpt / "chat_template.jinja").write_text(source)
    return ckpt


def chat_file(tmp_path, chats=CHATS, name="chat.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps({"messages": m}) + "\n" for m in chats))
    return path


# --- templates render under a time and a size limit -------------------------------------------


@pytest.mark.parametrize(
    "source, named",
    [
        ('{{ "x" * 3000000000 }}', "repeats a value 3000000000 times"),
        ('{{ 3000000000 * ["x"] }}', "repeats a value 3000000000 times"),
        ("{{ 10 ** 100000000 }}", "raises 10 to the power 100000000"),
        ('{{ "%3000000000s" % "a" }}', "formats a field 3000000000 characters wide"),
        ('{{ "%*s"|format(3000000000, "a") }}', "formats a field 3000000000 characters wide"),
        ('{{ "a"|center(3000000000) }}', "centers text in 3000000000 characters"),
        (
            '{% set ns = namespace(s="x") %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}',
            "joins strings of more than 16777216 characters",
        ),
        (
            '{% set ns = namespace(s=["x"]) %}{% for i in range(40) %}{% set ns.s = ns.s + ns.s %}{% endfor %}',
            "joins values of more than 16777216 items",
        ),
        ("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", "recursed past the interpreter's depth limit"),
    ],
)
def test_a_template_building_a_huge_value_is_refused_before_it_is_built(ckpt, tmp_path, source, named):
    message = refused(chat_file(tmp_path), with_template(ckpt, source))
    assert message.startswith(f"{ckpt}/chat_template.jinja: the chat template {named}"), message
    assert "while rendering" in message and "use the model's published template" in message


def test_a_template_of_nested_loops_is_stopped_at_the_deadline(ckpt, tmp_path, monkeypatch):
    monkeypatch.setattr(template_bounds, "MAX_RENDER_SECONDS", 0.5)
    loops = "{% for a in range(99999) %}{% for b in range(99999) %}{% for c in range(99999) %}{% endfor %}{% endfor %}{% endfor %}"
    assert len(loops) < 160
    message = refused(chat_file(tmp_path), with_template(ckpt, loops), timeout=10)
    assert "the chat template ran longer than 0.5 s while rendering" in message


# --- regular files only; bounded lines and cells ---------------------------------------------------


def test_a_fifo_calib_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "calib.jsonl"
    os.mkfifo(fifo)
    assert "not a regular file" in refused(fifo)


def test_a_long_line_is_refused_by_number_before_it_is_decoded(tmp_path, monkeypatch):
    monkeypatch.setattr(calib_files, "MAX_ROW_BYTES", 1024)
    path = tmp_path / "long.jsonl"
    path.write_text(json.dumps({"text": "short"}) + "\n" + json.dumps({"text": "x" * 4096}) + "\n")
    assert refused(path).startswith(f"{path}:2: a line longer than 1.00 KiB")


def test_a_parquet_dictionary_value_is_measured_before_any_row_copies_it(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "bomb.parquet"
    huge = "x" * (tables.MAX_CELL_BYTES + 1)
    pq.write_table(pa.table({"text": [huge] * 64}), path, use_dictionary=True, compression="zstd")
    assert path.stat().st_size < 64 << 10  # the file is small; decoded, 64 rows would be 1 GiB
    assert refused(path) == (
        f"{path}: a cell of {len(huge)} bytes, more than {tables.MAX_CELL_BYTES}; calibration reads a few "
        "thousand tokens of a row: cut the long rows, or give the text as a .txt file"
    )


def saved_dataset(tmp_path):
    datasets = pytest.importorskip("datasets")
    path = tmp_path / "saved"
    datasets.Dataset.from_dict({"text": ["The river ran low.", "Tokens travel."]}).save_to_disk(str(path))
    return path


def test_a_saved_dataset_whose_arrow_file_is_a_fifo_is_refused(tmp_path):
    path = saved_dataset(tmp_path)
    arrow = next(p for p in path.iterdir() if p.suffix == ".arrow")
    arrow.unlink()
    os.mkfifo(arrow)
    assert refused(path) == (
        f"{arrow}: not a regular file (a pipe, device or socket); save the dataset again with save_to_disk"
    )


def test_a_saved_dataset_linking_out_of_its_directory_is_refused(tmp_path):
    path = saved_dataset(tmp_path)
    arrow = next(p for p in path.iterdir() if p.suffix == ".arrow")
    outside = tmp_path / "elsewhere.arrow"
    arrow.rename(outside)
    arrow.symlink_to(outside)
    assert refused(path).startswith(f"{arrow}: links to {outside}, outside the dataset {path}")


# --- formats by content as well as suffix; content that is not text ---------------------------------


def test_a_json_array_of_chats_and_an_upper_case_jsonl_read_as_rows(tmp_path):
    expected = read(chat_file(tmp_path), n=4, t=16)
    array = tmp_path / "chats.json"
    array.write_text(json.dumps([{"messages": m} for m in CHATS]))
    upper = chat_file(tmp_path, name="CHATS.JSONL")
    unnamed = chat_file(tmp_path, name="chats")
    for path in (array, upper, unnamed):
        assert torch.equal(read(path, n=4, t=16), expected), path


@pytest.mark.parametrize(
    "content, named",
    [
        (None, "content is null, not text"),
        (7, "content is int, not text"),
        ([{"type": "image_url", "image_url": {"url": "x"}}], "content part 0 is 'image_url', not text"),
    ],
)
def test_message_content_that_is_not_text_is_refused_by_name(tmp_path, content, named):
    chats = [[{"role": "user", "content": content}]]
    path = chat_file(tmp_path, chats)
    assert refused(path).startswith(f"{path}:1 message 0: {named}")


def test_text_parts_read_as_the_text_they_hold(tmp_path):
    parts = [[{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]} for m in c] for c in CHATS]
    assert torch.equal(read(chat_file(tmp_path, parts, "parts.jsonl")), read(chat_file(tmp_path)))


# --- the checkpoint's files are read inside it ----------------------------------------------------


@pytest.mark.parametrize("name", ["chat_template.jinja", "tokenizer.json", "tokenizer_config.json"])
def test_a_checkpoint_file_linking_outside_it_is_refused(ckpt, tmp_path, name):
    outside = tmp_path / f"secret-{name}"
    if (ckpt / name).exists():
        (ckpt / name).rename(outside)
    else:
        outside.write_text("{{ messages }}")
    (ckpt / name).symlink_to(outside)
    message = refused(chat_file(tmp_path), ckpt)
    assert message.startswith(f"{ckpt} ({name}): {name} links to {outside}, outside {ckpt}"), message


def test_token_ids_are_still_read_by_suffix(tmp_path):
    ids = np.arange(32, dtype=np.int32)
    np.save(tmp_path / "ids.npy", ids)
    assert torch.equal(read(tmp_path / "ids.npy", n=2, t=8).view(-1), torch.arange(16))
