"""`eprt-ptq --nproc-per-node N`: the ranks start through torch's elastic launcher, and a failed run
ends with one line naming the first failing rank, how it ended and why, with no launcher traceback."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from eprt.hf.convert import convert_hf
from eprt.testing.tiny import make_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTQ = [sys.executable, "tools/ptq.py", "--nproc-per-node", "2"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("launch")
    return convert_hf(make_tiny("qwen3_moe", str(d / "hf")), str(d / "ck"), progress=False)


def last_line(stderr: str) -> str:
    return stderr.strip().splitlines()[-1]


def assert_no_launcher_traceback(stderr: str) -> None:
    assert "ChildFailedError" not in stderr and "torch/distributed/elastic" not in stderr, stderr[-3000:]


RANK_FAILED = ("error (rank 0 of 2, exit code 2): ", "error (rank 1 of 2, exit code 2): ")


@pytest.mark.parametrize(
    "args,cause,before_ranks",
    [
        # refused from the arguments and the manifest before any rank starts
        (["--ep", "3"], "ep=3 does not divide the world size 2; valid ep for world 2: 1, 2", True),
        (["--recipe", "int3"], "--recipe 'int3': no such recipe", True),
        (["--calib", "missing.jsonl"], "missing.jsonl", True),
        # refused by the ranks together, once they have met (the memory plan needs them)
        (["--max-memory", "1KiB"], "over --max-memory 1.00 KiB", False),
    ],
)
def test_a_refusal_is_one_line(ckpt, tmp_path, args, cause, before_ranks):
    r = subprocess.run(
        [*PTQ, ckpt, "--recipe", "nvfp4", "--out", str(tmp_path / "q"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2, r.stderr[-3000:]
    # said once, not by each rank and again by the launcher (a verdict of the ranks together lists
    # each failing rank below its line)
    line, *ranks = r.stderr.strip().splitlines()
    assert line.startswith("error: " if before_ranks else RANK_FAILED), line
    assert not ranks if before_ranks else all(x.startswith("  rank ") for x in ranks), r.stderr
    assert cause in r.stderr
    assert_no_launcher_traceback(r.stderr)
    assert not (tmp_path / "q").exists()


def rank_pid(launcher: int, rank: int) -> int | None:
    """The pid of the launcher's child that runs `rank`, from /proc."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[1])
            env = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
        except OSError:
            continue
        if ppid == launcher and f"RANK={rank}".encode() in env:
            return int(pid)
    return None


def test_a_killed_rank_is_named_with_its_signal(ckpt, tmp_path):
    p = subprocess.Popen(
        [
            *PTQ,
            ckpt,
            "--recipe",
            "nvfp4",
            "--calib-size",
            "512",
            "--seq-len",
            "256",
            "--eval-size",
            "0",
            "--out",
            str(tmp_path / "q"),
        ],
        cwd=ROOT,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "EPRT_PEER_TIMEOUT": "5"},
    )
    said = []
    for line in p.stderr:  # rank 0 plans its memory once both ranks have joined
        said.append(line)
        if "memory plan" in line:
            break
    victim = rank_pid(p.pid, 1)
    assert victim, "".join(said)
    os.kill(victim, signal.SIGKILL)
    start = time.monotonic()
    said += p.stderr.readlines()
    assert p.wait(timeout=120) == 1
    stderr = "".join(said)
    assert last_line(stderr) == (
        "error (rank 1 of 2, SIGKILL): killed by SIGKILL (the kernel's out-of-memory "
        "killer, or by hand); the other ranks were stopped"
    ), stderr[-3000:]
    assert time.monotonic() - start < 60
    assert_no_launcher_traceback(stderr)
    assert not (tmp_path / "q").exists()


def test_a_launched_rank_does_not_launch_again(ckpt, tmp_path):
    r = subprocess.run(
        [*PTQ, ckpt, "--recipe", "nvfp4", "--out", str(tmp_path / "q")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "RANK": "0", "WORLD_SIZE": "2"},
    )
    assert r.returncode == 2
    assert r.stderr.strip() == (
        "error (rank 0 of 2): --nproc-per-node starts the ranks itself, but this process is "
        "already rank 0 of a launched run: leave --nproc-per-node out under torchrun or srun"
    )


def test_chat_data_without_a_chat_template_is_refused_before_the_ranks_start(tmp_path):
    hf = make_tiny("qwen3_moe", str(tmp_path / "hf"))
    config = json.load(open(os.path.join(hf, "tokenizer_config.json")))
    del config["chat_template"]
    json.dump(config, open(os.path.join(hf, "tokenizer_config.json"), "w"))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False, reference=True)
    chats = tmp_path / "chats.jsonl"
    chats.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    r = subprocess.run(
        [*PTQ, ck, "--recipe", "nvfp4", "--out", str(tmp_path / "q"), "--calib", str(chats)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert line.startswith("error: ") and "chat template" in line, line
