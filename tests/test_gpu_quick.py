"""`make gpu-quick` without a GPU: it refuses at once unless asked for its CPU mode; each step is capped
and killed with what it started at its cap; the JSON is written after every step; --rerun runs only
the steps that did not pass. (The whole CPU mode, every step, takes under four minutes here:
docs/gpu-check.md.)"""

import json
import os
import subprocess
import sys
import time

import pytest

from eprt.errors import ConfigError
from eprt.parallel import state

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_GPU = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


def start(out, *args):
    """The check as `make gpu-quick` runs it, $OUT set as on the GPU machine; its output in OUT/log."""
    log = open(out / "log", "w")
    return subprocess.Popen(
        [sys.executable, "bench/gpu_quick.py", *args],
        cwd=ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**NO_GPU, "OUT": str(out)},
    )


def finished(p, out) -> str:
    p.wait(timeout=300)
    return (out / "log").read_text()


def steps(out) -> dict:
    with open(out / "gpu-quick.json") as f:
        return json.load(f)["steps"]


def test_without_cuda_it_stops_at_once_and_says_why(tmp_path):
    p = start(tmp_path)
    output = finished(p, tmp_path)
    assert p.returncode == 2, output
    env = steps(tmp_path)["environment"]
    assert env["status"] == "failed" and "run with --cpu for the CPU mode" in env["reason"]
    assert {s["status"] for n, s in steps(tmp_path).items() if n != "environment"} == {"pending"}


def test_steps_are_capped_saved_as_they_end_and_rerun_when_they_did_not_pass(tmp_path):
    p = start(tmp_path, "--cpu", "--steps", "memory,gemm", "--cap", "memory=2")
    seen = set()  # (step, status) pairs the JSON showed while the check ran
    while p.poll() is None:
        try:
            seen |= {(n, s["status"]) for n, s in steps(tmp_path).items()}
        except (OSError, ValueError):
            pass
        time.sleep(0.2)
    output = finished(p, tmp_path)
    assert p.returncode == 1, output
    first = steps(tmp_path)
    assert first["memory"]["status"] == "timeout" and first["memory"]["seconds"] < 2 + 10
    assert first["gemm"]["status"] == "passed" and first["gemm"]["figures"]["rows"]
    assert ("memory", "timeout") in seen and ("gemm", "pending") in seen  # saved before gemm ran
    assert {first[n]["status"] for n in ("layouts", "gptq", "kernels")} == {"skipped"}
    assert {first[n]["status"] for n in ("install", "kda")} == {"skipped"}  # not in the CPU mode

    p = start(tmp_path, "--cpu", "--steps", "memory,gemm", "--rerun")
    output = finished(p, tmp_path)
    assert p.returncode == 0, output
    again = steps(tmp_path)
    assert again["gemm"] == {**first["gemm"], "kept_from_last_run": True}
    memory = again["memory"]["figures"]
    assert again["memory"]["status"] == "passed" and memory["planned_peak_bytes"] > 0
    assert memory["estimated_calibration_s"] > 0 and memory["measured_peak_reserved_bytes"] > 0


class Store:
    """The run's store as `_bind_device` uses it, every rank's report posted."""

    def __init__(self, reports):
        self.kv = dict(reports)

    def set(self, key, value):
        self.kv[key] = value.encode()

    def wait(self, keys, timeout):
        assert all(k in self.kv for k in keys)

    def get(self, key):
        return self.kv[key]


def test_two_ranks_share_the_one_gpu_only_when_asked(monkeypatch):
    """The layouts step runs world 2 on a machine of one GPU: EPRT_RANKS_SHARE_GPU=1 lets the ranks of a
    node take it in turn (over gloo); a run's ranks are refused one GPU between two."""
    monkeypatch.setattr(state.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(state.torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(state.torch.cuda, "set_device", lambda gpu: None)
    store = Store({"device/0": b"1 2 node"})
    with pytest.raises(ConfigError, match="2 ranks run on host node, which has 1 visible GPUs"):
        state._bind_device(store, 1, 2, 1, 2, None)
    monkeypatch.setenv("EPRT_RANKS_SHARE_GPU", "1")
    assert state._bind_device(store, 1, 2, 1, 2, None) == state.torch.device("cuda", 0)
