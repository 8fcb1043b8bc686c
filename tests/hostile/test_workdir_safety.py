"""Nothing outside what a run created is ever deleted, and an output is always there.

The work directory is removed when a calibration ends, so it must be one eprt made: never an
input, the output, or a directory of the user's; only the files the run wrote there go. An
output replaced with --overwrite is at OUT at every moment, whenever the run is killed. A
refused write names the path and whether it was the output or the work directory."""

import errno
import os
import shutil

import pytest

import eprt.quant.run.workdir as workdir
import eprt.storage.atomic as atomic
from eprt.cli import run
from eprt.errors import EprtError
from eprt.hf.convert import convert_hf
from eprt.parallel import ParallelState
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.atomic import atomic_output_dir
from eprt.testing.tiny import make_tiny
from tests.hf_utils import tree_digest


def ptq(ck: str, out: str, **kw) -> dict:
    return run_ptq(
        ParallelState.single("cpu"), PTQArgs(ck, "fp8", out, calib_size=2, seq_len=8, eval_size=0, progress=False, **kw)
    )


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("workdir")
    return convert_hf(make_tiny("qwen3_moe", str(root / "hf")), str(root / "ck"), progress=False)


def a_user_directory(path) -> str:
    os.makedirs(path / "notes")
    (path / "notes" / "todo.txt").write_text("mine")
    (path / "results.csv").write_text("1,2")
    return str(path)


# --- the work directory is never an input, the output or the user's -----------------------------


@pytest.mark.parametrize(
    "where",
    [
        "the checkpoint",
        "inside the checkpoint",
        "holding the checkpoint",
        "holding the calibration data",
        "the recipe file",
    ],
)
def test_a_work_directory_overlapping_an_input_is_refused_and_the_input_kept(ck, tmp_path, where):
    inputs = shutil.copytree(ck, tmp_path / "in" / "ck", symlinks=True)
    data = tmp_path / "data"
    os.makedirs(data)
    (data / "calib.txt").write_text("the quick brown fox jumps over the lazy dog " * 20)
    recipe = tmp_path / "r.yaml"
    recipe.write_text("quantize:\n- pattern: '*'\n  format: fp8\n")
    work = {
        "the checkpoint": inputs,
        "inside the checkpoint": inputs / "work",
        "holding the checkpoint": tmp_path / "in",
        "holding the calibration data": data,
        "the recipe file": recipe,
    }[where]
    before = {d: tree_digest(str(d)) for d in (tmp_path / "in", data)}
    with pytest.raises(EprtError, match=r"--work-dir .* overlaps .*, which this run reads"):
        run_ptq(
            ParallelState.single("cpu"),
            PTQArgs(
                str(inputs),
                str(recipe),
                str(tmp_path / "q"),
                calib=str(data / "calib.txt"),
                calib_size=2,
                seq_len=8,
                eval_size=0,
                progress=False,
                work_dir=str(work),
            ),
        )
    assert {d: tree_digest(str(d)) for d in before} == before
    assert recipe.read_text().startswith("quantize")
    assert not os.path.exists(tmp_path / "q")


@pytest.mark.parametrize("where", ["the output", "inside the output", "holding the output"])
def test_a_work_directory_overlapping_the_output_is_refused_and_the_old_output_kept(ck, tmp_path, where):
    out = tmp_path / "runs" / "q"
    ptq(ck, str(out))
    before = tree_digest(str(out))
    work = {"the output": out, "inside the output": out / "work", "holding the output": tmp_path / "runs"}[where]
    with pytest.raises(EprtError, match=r"--work-dir .* overlaps the output"):
        ptq(ck, str(out), overwrite=True, work_dir=str(work))
    assert tree_digest(str(out)) == before


def test_a_users_directory_as_work_directory_is_refused_and_kept(ck, tmp_path):
    scratch = a_user_directory(tmp_path / "scratch")
    before = tree_digest(scratch)
    with pytest.raises(EprtError, match=rf"--work-dir {scratch} exists and holds files eprt did not write"):
        ptq(ck, str(tmp_path / "q"), work_dir=scratch)
    assert tree_digest(scratch) == before
    assert not os.path.exists(tmp_path / "q")


def test_a_run_removes_only_what_it_wrote_in_its_work_directory(ck, tmp_path):
    """A killed run's work directory, where the user has since put files: a fresh run (without
    --resume) drops the killed run's layers and, once done, its own, and leaves the user's files."""
    out, work = str(tmp_path / "q"), tmp_path / "q.work"
    killed_after_layer(ck, out, 0)
    assert os.listdir(work / "rank-00000") == ["layer-00000.safetensors"]
    (work / "rank-00000" / "mine.txt").write_text("keep")
    (work / "notes.txt").write_text("keep too")
    ptq(ck, out)
    assert sorted(os.listdir(work)) == ["notes.txt", "rank-00000"]
    assert os.listdir(work / "rank-00000") == ["mine.txt"]


def test_an_empty_directory_of_the_user_is_used_and_left_in_place_empty(ck, tmp_path):
    os.makedirs(tmp_path / "scratch")
    ptq(ck, str(tmp_path / "q"), work_dir=str(tmp_path / "scratch"))
    assert os.listdir(tmp_path / "scratch") == []
    assert os.path.isdir(tmp_path / "q")


def test_the_default_work_directory_is_gone_once_the_output_is_written(ck, tmp_path):
    ptq(ck, str(tmp_path / "q"))
    assert sorted(os.listdir(tmp_path)) == ["q"]


def stop_after_layer(run, layer: int) -> None:
    """`run()` stopped once `layer` is saved, as a killed run is: its work directory stays."""
    run_layer = LayerEngine.run_layer

    def stopping(self, i, ls, pb):
        if i == layer + 1:
            raise KeyboardInterrupt
        return run_layer(self, i, ls, pb)

    LayerEngine.run_layer = stopping
    try:
        with pytest.raises(BaseException, match="KeyboardInterrupt"):
            run()
    finally:
        LayerEngine.run_layer = run_layer


def killed_after_layer(ck: str, out: str, layer: int, **kw) -> None:
    stop_after_layer(lambda: ptq(ck, out, **kw), layer)


# --- an output replaced with --overwrite is always at OUT ----------------------------------------


def contents(d) -> dict[str, str]:
    return {f: open(os.path.join(d, f)).read() for f in sorted(os.listdir(d))}


def publish_killed_at(tmp_path, step: int, exchange: bool) -> bool:
    """Replace OUT (holding `old`) with `new` in a child process killed (os._exit, no cleanup)
    before its `step`-th change to the file system; True when it finished first."""
    out = str(tmp_path / "out")
    with atomic_output_dir(out) as tmp:
        open(os.path.join(tmp, "old"), "w").write("old")
    pid = os.fork()
    if pid == 0:
        done = [0]

        def counted(fn):
            def step_or_die(*args, **kw):
                if done[0] == step:
                    os._exit(9)
                done[0] += 1
                return fn(*args, **kw)

            return step_or_die

        for module, name in ((os, "rename"), (os, "replace"), (shutil, "rmtree"), (atomic, "exchange_names")):
            if hasattr(module, name):
                setattr(module, name, counted(getattr(module, name)))
        if not exchange and hasattr(atomic, "exchange_names"):
            atomic.exchange_names = counted(lambda a, b: False)
        with atomic_output_dir(out, overwrite=True) as tmp:
            open(os.path.join(tmp, "new"), "w").write("new")
        os._exit(0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0


def test_overwrite_killed_at_any_step_leaves_the_old_or_the_new_output(tmp_path):
    for step in range(10):
        root = tmp_path / str(step)
        os.makedirs(root)
        finished = publish_killed_at(root, step, exchange=True)
        assert contents(root / "out") in ({"old": "old"}, {"new": "new"}), step
        if finished:
            assert contents(root / "out") == {"new": "new"} and os.listdir(root) == ["out"]
            return
    raise AssertionError("publish never finished")


def test_overwrite_without_an_exchange_keeps_the_old_output_whole_beside_it(tmp_path):
    """Where the file system cannot exchange names, a kill between the two renames leaves the old
    output complete at .out.old-* (docs/security.md), never nothing."""
    for step in range(10):
        root = tmp_path / str(step)
        os.makedirs(root)
        finished = publish_killed_at(root, step, exchange=False)
        if os.path.exists(root / "out"):
            assert contents(root / "out") in ({"old": "old"}, {"new": "new"}), step
        else:
            aside = [d for d in os.listdir(root) if d.startswith(".out.old-")]
            assert len(aside) == 1 and contents(root / aside[0]) == {"old": "old"}, step
        if finished:
            assert contents(root / "out") == {"new": "new"} and os.listdir(root) == ["out"]
            return
    raise AssertionError("publish never finished")


# --- a refused write names the path and what it was writing ---------------------------------------


def refusal_of(fn, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        run(fn)
    assert e.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if not line.startswith("[eprt")]  # the log
    assert len(lines) == 1, lines
    return lines[0]


def full(*args, **kw):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_full_disk_in_the_work_directory_names_it(ck, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(workdir, "save_tensors", full)
    work = tmp_path / "scratch-disk" / "w"
    line = refusal_of(lambda: ptq(ck, str(tmp_path / "q"), work_dir=str(work)), capsys)
    assert line.startswith(
        f"error: {work}/rank-00000/layer-00000.safetensors: the disk is full writing the work directory {work}"
    ), line
    assert "--work-dir" in line
    assert not os.path.exists(tmp_path / "q")


def test_a_full_disk_in_the_output_names_it(ck, tmp_path, monkeypatch, capsys):
    import eprt.quant.calibrated as calibrated

    monkeypatch.setattr(calibrated, "save_tensors", full)
    out = tmp_path / "q"
    line = refusal_of(lambda: ptq(ck, str(out)), capsys)
    assert line.startswith(f"error: {tmp_path}/.q.partial-"), line
    assert f"the disk is full writing the output {out}" in line, line
    assert "write the output elsewhere" in line
    assert not os.path.exists(out)
