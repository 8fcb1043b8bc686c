"""Fixtures of the hostile-rank tests (test_hostile_ranks.py, test_rank_liveness.py)."""

import os
import signal
import subprocess

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
