"""tools/ptq.py --dry-run: the layout and each rank's weight bytes, under torchrun and alone, and the
refusal of an ep that does not split the experts, on every rank."""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

from eprt.commands.ptq_run import size
from eprt.hf.convert import convert_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.quant.run.setup import plan_recipe
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.multiproc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTQ = os.path.join(ROOT, "tools", "ptq.py")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ptq")
    eight = make_tiny("qwen3_moe", str(root / "hf8"), dtype="fp32")
    three = make_tiny("qwen3_moe", str(root / "hf3"), dtype="fp32", num_experts=3)
    return (convert_hf(eight, str(root / "ck8"), progress=False), convert_hf(three, str(root / "ck3"), progress=False))


def stored_bytes(ck_dir: str, ep: int) -> tuple[int, int]:
    """(dense, one rank's routed experts) in bytes as stored: the checkpoint is fp32, as is the run."""
    ck = Checkpoint(ck_dir)
    dense = experts = 0
    for name in ck.names():
        t = ck.meta(name)
        n = t.dtype.itemsize * math.prod(t.shape)
        if re.search(r"\.mlp\.experts\.w(13|2)$", name):
            experts += n // ep
        else:
            dense += n
    return dense, experts


def rows(stdout: str) -> list[list[str]]:
    """The table's rank rows, split on runs of two or more spaces."""
    return [re.split(r"\s{2,}", line.strip()) for line in stdout.splitlines() if re.match(r"\s+\d+\s", line)]


def run(args, env=None, timeout=60):
    return subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env={**os.environ, **(env or {})}
    )


@pytest.mark.timeout(120)
def test_dry_run_alone_and_under_torchrun(ckpts):
    ck8, _ = ckpts

    r = run([sys.executable, PTQ, ck8, "--dry-run", "--dtype", "fp32", "--recipe", "fp8", "--estimate-time"])
    assert r.returncode == 0, r.stderr
    assert "world 1 = edp 1 x ep 1" in r.stdout
    # the time a run takes, probed on this machine's device: 64 sequences of 256 tokens in 16 steps of
    # one group of 4 (tests/test_estimate.py checks the steps against a run's)
    assert re.search(
        r"\ncalibration time on cpu: rank 0 about [\d.]+ s( \(\d+ min\))? \(2 MoE x \(16 steps x [\d.e-]+ s \+ "
        r"[\d.e-]+ s \+ reading [\d.e-]+ s\), 1 dense-MLP x \(16 steps x [\d.e-]+ s \+ [\d.e-]+ s \+ reading "
        r"[\d.e-]+ s\), 3 saves to the work directory not counted \(no --work-dir or --out given\)\)\n",
        r.stdout,
    ), r.stdout
    assert "8 routed experts in each of MoE layers 0, 2" in r.stdout
    dense, experts = stored_bytes(ck8, 1)
    (row,) = rows(r.stdout)
    assert row[:7] == ["0", "0", "0", "[0, 8)", size(dense), size(experts), size(dense + experts)]
    assert re.fullmatch(r"[\d.]+ (MiB|GiB)", row[7])  # the planned peak (tests/test_ptq_memory.py checks it)

    r = run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "2",
            f"--master-port={free_port()}",
            PTQ,
            ck8,
            "--ep",
            "2",
            "--dry-run",
            "--dtype",
            "fp32",
        ],
        timeout=100,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("world 2 = edp 1 x ep 2") == 1  # rank 0 alone prints
    assert "ep groups (exchange tokens, split the experts): [0, 1]\n" in r.stdout
    assert "edp groups (hold the same experts): [0] [1]\n" in r.stdout
    dense, experts = stored_bytes(ck8, 2)
    share = [size(dense), size(experts), size(dense + experts)]
    assert [row[:7] for row in rows(r.stdout)] == [["0", "0", "0", "[0, 4)", *share], ["1", "0", "1", "[4, 8)", *share]]


@pytest.mark.timeout(120)
def test_refuses_an_ep_that_does_not_split_the_experts_on_every_rank(ckpts):
    _, ck3 = ckpts
    # Two ranks started as torchrun starts them, without its agent, to see each one's exit code.
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, PTQ, ck3, "--ep", "2", "--dry-run"],
            cwd=ROOT,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={
                **os.environ,
                "RANK": str(rank),
                "LOCAL_RANK": str(rank),
                "WORLD_SIZE": "2",
                "LOCAL_WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
                "CUDA_VISIBLE_DEVICES": "",
            },
        )
        for rank in range(2)
    ]
    try:
        outs = [p.communicate(timeout=100) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for rank, (p, (stdout, stderr)) in enumerate(zip(procs, outs)):
        assert p.returncode == 2, stderr
        assert stdout == ""
        assert stderr == (
            f"error (rank {rank} of 2): ep=2 does not divide the 3 routed experts; "
            "valid ep for world 2 and 3 experts: 1\n"
        )

    r = run([sys.executable, PTQ, ck3, "--ep", "2", "--dry-run"])
    assert r.returncode == 2
    assert r.stderr == "error: ep=2 does not divide the world size 1; valid ep for world 1: 1\n"


@pytest.mark.timeout(120)
def test_dry_run_plans_gpu_ranks_from_a_host_without_one(ckpts):
    """A login node without GPUs plans the GPU run: the device's terms, and the host memory GPTQ's codes
    take beside the process (NVFP4: half a byte a weight), in the table and in the plan's line."""
    ck8, _ = ckpts
    r = run(
        [
            *(sys.executable, PTQ, ck8, "--dry-run", "--recipe", "nvfp4", "--algorithm", "gptq"),
            *("--device", "cuda", "--estimate-time"),
        ],
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert r.returncode == 0, r.stderr
    # no GPU here to probe the time on: said, with where to get it
    assert r.stdout.endswith(
        "\ncalibration time on cuda: not estimated on this cpu machine (the probe runs a layer on the device "
        "itself): run this dry run with --estimate-time on one cuda node, as many local ranks as the run starts "
        "there\n"
    ), r.stdout
    assert "planned peak on cuda" in r.stdout
    (row,) = rows(r.stdout)
    assert len(row) == 9 and re.fullmatch(r"[\d.]+ (KiB|MiB|GiB)", row[8])  # the host's column
    line = next(line for line in r.stdout.splitlines() if line.startswith("memory plan on cuda: rank 0 peaks at "))
    m = re.fullmatch(
        r"memory plan on cuda: rank 0 peaks at (\S+ \S+) \(layer .*, hidden states .*, step .*, "
        r"process 0 B, CUDA context, cuBLAS and NCCL 832.00 MiB, the allocator's reserve [^,]*, "
        r"GPTQ's Hessians [^,]*, quality report: .* head [^)]*\); on the host (\S+ \S+) "
        r"\(process .*, token ids .*, a tensor as read .*, GPTQ's codes (\S+ \S+)\)",
        line,
    )
    assert m, line
    assert (m.group(1), m.group(2)) == (row[7], row[8])
    with Checkpoint(ck8) as ck:  # every weight of every Linear the recipe quantizes
        _, targets = plan_recipe(ResolvedCheckpoint.of(ck, torch.float32), "nvfp4")
        weights = sum(math.prod(ck.meta(n).shape) for n in ck.names() if n.rpartition(".")[0] in targets)
    assert m.group(3) == size(weights // 2)

    r = run(
        [
            sys.executable,
            PTQ,
            ck8,
            "--dry-run",
            "--recipe",
            "nvfp4",
            "--algorithm",
            "gptq",
            "--device",
            "cuda",
            "--max-host-memory",
            "1MiB",
        ],
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert r.returncode == 2
    assert re.fullmatch(
        r"error: rank 0 would hold [\d.]+ MiB of host memory \(process .*\); with the 1 ranks on "
        r"its host, [\d.]+ MiB, over --max-host-memory 1.00 MiB: use fewer ranks on each host, or "
        r"a host with more memory free\n",
        r.stderr,
    ), r.stderr


def test_device_is_for_the_dry_run_a_run_uses_its_ranks_own(ckpts, tmp_path):
    ck8, _ = ckpts
    r = run(
        [sys.executable, PTQ, ck8, "--recipe", "fp8", "--out", str(tmp_path / "q"), "--device", "cuda"],
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert r.returncode == 2
    assert r.stderr == (
        "error: --device cuda: this rank runs on cpu; --device plans for another machine with "
        "--dry-run, a run uses its ranks' own devices\n"
    ), r.stderr
    assert not (tmp_path / "q").exists()
