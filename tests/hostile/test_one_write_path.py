"""Every file eprt writes goes through one primitive (eprt.storage.atomic.atomic_file): a new file
beside the target, created without following a link, synced and renamed over the target. A link
planted where eprt writes is replaced, never written through; a refused write names the path; a
failure leaves nothing behind."""

import errno
import json
import os

import pytest

from eprt.errors import EprtError
from eprt.storage import atomic
from eprt.storage.atomic import atomic_file, new_file, write_file
from eprt.storage.hf_files import QUALITY, QUALITY_PAGE
from tests.hf_utils import eprt_report


@pytest.fixture
def export(tmp_path, quality_report):
    """An export's report, as eprt-report finds it."""
    d = tmp_path / "export"
    d.mkdir()
    (d / QUALITY).write_text(json.dumps(quality_report))
    return d


def test_a_link_planted_where_the_page_goes_is_replaced_not_written_through(export, tmp_path, monkeypatch, capsys):
    victim = tmp_path / "authorized_keys"
    victim.write_text("ssh-ed25519 KEEP\n")
    for name in (QUALITY_PAGE, QUALITY_PAGE + ".tmp", f".{QUALITY_PAGE}.partial-{os.getpid()}-0"):
        (export / name).symlink_to(victim)
    code, out = eprt_report(monkeypatch, capsys, export)
    assert code == 0, out
    assert victim.read_text() == "ssh-ed25519 KEEP\n"
    page = export / QUALITY_PAGE
    assert not page.is_symlink() and page.read_text().startswith("<!DOCTYPE html>")
    assert sorted(os.listdir(export)) == sorted(
        [QUALITY, QUALITY_PAGE, QUALITY_PAGE + ".tmp", f".{QUALITY_PAGE}.partial-{os.getpid()}-0"]
    )


def test_out_naming_a_directory_is_refused_and_leaves_nothing(export, tmp_path, monkeypatch, capsys):
    out = tmp_path / "pages"
    out.mkdir()
    code, text = eprt_report(monkeypatch, capsys, export, "--out", out)
    assert code == 2 and f"{out} is a directory; name a file to write the report's page to" in text
    assert "Traceback" not in text
    assert os.listdir(out) == [] and sorted(os.listdir(tmp_path)) == ["export", "pages"]


def test_a_full_disk_names_the_path_and_leaves_nothing(export, tmp_path, monkeypatch, capsys):
    def full(*_args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic, "fsync_path", full)
    out = tmp_path / "page.html"
    code, text = eprt_report(monkeypatch, capsys, export, "--out", out)
    assert code == 2 and f"{out}: the disk is full writing the report's page" in text, text
    assert "Traceback" not in text
    assert sorted(os.listdir(tmp_path)) == ["export"]


def test_a_write_that_fails_midway_leaves_the_old_file_and_no_temp(tmp_path):
    target = tmp_path / "recipe.yaml"
    target.write_text("old\n")
    with pytest.raises(RuntimeError):
        with atomic_file(str(target)) as f:
            f.write("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old\n" and os.listdir(tmp_path) == ["recipe.yaml"]
    write_file(str(target), "new\n")
    assert target.read_text() == "new\n" and os.listdir(tmp_path) == ["recipe.yaml"]


def test_new_file_never_writes_through_a_link_or_over_a_file(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    (tmp_path / "link").symlink_to(victim)
    with pytest.raises(OSError):
        new_file(str(tmp_path / "link"))
    with pytest.raises(FileExistsError):
        new_file(str(victim))
    assert victim.read_text() == "keep"


def test_a_permission_refusal_names_the_path(tmp_path, monkeypatch):
    real_open = os.open

    def forbidden(path, flags, *args):
        if flags & os.O_CREAT:
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", forbidden)
    with pytest.raises(EprtError, match=f"{tmp_path}/page.html: permission denied writing a file"):
        write_file(str(tmp_path / "page.html"), "x")
    assert os.listdir(tmp_path) == []
