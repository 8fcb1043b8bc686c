"""Fixtures of the hostile-rank tests (test_hostile_ranks.py, test_rank_liveness.py) and of those reading reports."""

import os
import signal
import subprocess
from dataclasses import replace

import pytest


@pytest.fixture
def agents():
    """The torchrun agents a test starts; whatever a failed test leaves running is killed."""
    started: list[subprocess.Popen] = []
    yield started
    for a in started:
        if a.poll() is None:
            os.killpg(a.pid, signal.SIGKILL)
            a.wait()


@pytest.fixture(scope="session")
def quality_report(tmp_path_factory) -> dict:
    """A real PTQ run's quality report (qwen3_moe, NVFP4, three held-out sequences, a preview)."""
    from eprt.hf.convert import convert_hf
    from eprt.parallel import ParallelState
    from eprt.quant.run.ptq import PTQArgs, run_ptq
    from eprt.testing.tiny import make_tiny

    d = tmp_path_factory.mktemp("report")
    ck = convert_hf(make_tiny("qwen3_moe", str(d / "hf")), str(d / "ck"), progress=False)
    args = PTQArgs(ck, "nvfp4", str(d / "q"), calib_size=6, seq_len=24, group_tokens=48, dtype="fp32", progress=False)
    return run_ptq(ParallelState.single("cpu"), replace(args, eval_size=3, preview="The river"))["quality"]
