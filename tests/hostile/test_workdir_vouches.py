"""The work directory vouches for everything a --resume continues from: each layer's record lists
every side file it relies on (GPTQ's codes, AWQ's folds of the layers before) with its SHA-256, and
a resume refuses a missing or edited one by name. The directory is held by an exclusive lock: a
second run given it while the first runs is refused."""

import os
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import pytest

from eprt.errors import EprtError
from eprt.hf.convert import convert_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.run.workdir_lock import HELD, LOCK_FILE
from eprt.testing.tiny import make_tiny
from tests.hostile.test_workdir_safety import stop_after_layer

SIDE = {"gptq": "gptq-00000.safetensors", "awq": "awq-00000.safetensors"}


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("vouch")
    return convert_hf(make_tiny("qwen3_moe", str(root / "hf")), str(root / "ck"), progress=False)


def args(ck, tmp_path, algorithm):
    calib = tmp_path / "ids.npy"
    np.save(calib, np.arange(64, dtype=np.int64) % 500)
    return PTQArgs(
        ck,
        "int4_g32",
        str(tmp_path / "q"),
        calib=str(calib),
        calib_size=4,
        seq_len=16,
        eval_size=0,
        progress=False,
        algorithm=algorithm,
    )


def stopped_after_layer_1(a: PTQArgs) -> str:
    """A run killed once layer 1 is saved; returns its rank directory."""
    stop_after_layer(lambda: run_ptq(ParallelState.single("cpu"), a), 1)
    return f"{a.out}.work/rank-00000"


def remove(path):
    os.remove(path)


def edit(path):
    with open(path, "r+b") as f:  # one byte of the data, the header left whole
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))


@pytest.mark.parametrize("algorithm", ["gptq", "awq"])
@pytest.mark.parametrize(
    "damage, named", [(remove, "missing; the saved layer 1 relies on it"), (edit, "changed since it was saved")]
)
def test_a_side_file_removed_or_edited_is_refused_on_resume(ck, tmp_path, algorithm, damage, named):
    a = args(ck, tmp_path, algorithm)
    rank_dir = stopped_after_layer_1(a)
    side = os.path.join(rank_dir, SIDE[algorithm])
    assert os.path.isfile(side), sorted(os.listdir(rank_dir))
    damage(side)
    with pytest.raises(EprtError) as e:
        run_ptq(ParallelState.single("cpu"), replace(a, resume=True))
    assert f"{side}: {named}" in str(e.value) and "run without --resume to start over" in str(e.value)
    assert not os.path.exists(a.out)


def test_a_whole_side_file_resumes(ck, tmp_path):
    a = args(ck, tmp_path, "awq")
    stopped_after_layer_1(a)
    run_ptq(ParallelState.single("cpu"), replace(a, resume=True))
    assert os.path.isdir(a.out) and not os.path.exists(f"{a.out}.work")


HOLDER = """
import sys, time
from eprt.quant.run.workdir_lock import hold
hold(sys.argv[1])
print("held", flush=True)
time.sleep(60)
"""


def test_a_work_directory_another_run_holds_is_refused(ck, tmp_path):
    a = args(ck, tmp_path, "awq")
    work = f"{a.out}.work"
    rank_dir = stopped_after_layer_1(a)
    saved = sorted(os.listdir(rank_dir))
    os.close(HELD.pop(os.path.realpath(work)))  # the killed run's process ended: its lock with it
    assert os.path.isfile(os.path.join(work, LOCK_FILE))
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, work],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": os.getcwd()},
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        for resume in (True, False):  # neither a resume nor a fresh start touches it
            with pytest.raises(
                EprtError, match=f"--work-dir {work} is in use by another eprt run \\(pid {holder.pid}\\)"
            ):
                run_ptq(ParallelState.single("cpu"), replace(a, resume=resume))
            assert sorted(os.listdir(rank_dir)) == saved
    finally:
        holder.kill()
        holder.wait()
    time.sleep(0.1)
    run_ptq(ParallelState.single("cpu"), replace(a, resume=True))  # the holder gone: it resumes
    assert os.path.isdir(a.out) and not os.path.exists(work)
