"""The memory plan against the measured peak, and the refusal of a run that does not fit.

The plan prices the process itself (its resident set when the plan is made: interpreter, torch,
eprt) as its baseline, plus the terms of the layer-major run. The model is sized so that those
terms are as large as the baseline: 16 experts of 512 x 2048 in fp32, 200 MB per MoE layer.
"""

import math
import os
import re
import subprocess
import sys

import pytest
import torch

import eprt.quant.run.ptq as ptq_module
from eprt.errors import ConfigError
from eprt.hf.convert import convert_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.algorithms.awq.passes import AWQ
from eprt.quant.algorithms.awq.plan import awq_bytes
from eprt.quant.algorithms.gptq.layer import MOST_EXPERTS_STACKED
from eprt.quant.algorithms.gptq.plan import GPTQLinear
from eprt.quant.algorithms.gptq.solve import columns_of
from eprt.quant.algorithms.program import program_of
from eprt.quant.formats import WEIGHT_FORMATS
from eprt.quant.formats.base import ScaledByBlocks
from eprt.quant.run.memory_check import check_host_memory, check_memory
from eprt.quant.run.memory_plan import RunShape
from eprt.quant.run.planner import Planner
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.run.setup import plan_recipe
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from eprt.units import format_bytes
from tests.multiproc import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PTQ = os.path.join(ROOT, "tools", "ptq.py")
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
MiB = 2**20


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("mem")
    hf = make_tiny(
        "qwen3_moe",
        str(d / "hf"),
        dtype="fp32",
        hidden_size=512,
        moe_intermediate_size=2048,
        intermediate_size=2048,
        num_experts=16,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=64,
    )
    return convert_hf(hf, str(d / "ck"), progress=False)


def nbytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * UNITS[unit]


def peaks(stderr: str) -> list[tuple[float, float]]:
    """(measured, planned) of each rank that reported, in bytes."""
    return [(nbytes(m), nbytes(p)) for m, p in re.findall(r"peak memory ([\d.]+ \w+), planned ([\d.]+ \w+)", stderr)]


def ptq(args, world, tmp_path, timeout=300):
    launch = (
        [sys.executable]
        if world == 1
        else [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            str(world),
            f"--master-port={free_port()}",
        ]
    )
    return subprocess.run(
        [*launch, PTQ, *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )


# each world and each dtype once: the plan's terms for a dtype do not depend on the world; and AWQ,
# whose search and fold hold more than the layer (eprt.quant.algorithms.awq.plan), once
@pytest.mark.parametrize("world,dtype,algorithm", [(1, "fp32", "max"), (2, "bf16", "max"), (1, "bf16", "awq")])
def test_the_measured_peak_is_within_15_percent_of_the_plan(ckpt, tmp_path, world, dtype, algorithm):
    r = ptq(
        [
            ckpt,
            "--algorithm",
            algorithm,
            "--recipe",
            "nvfp4",
            "--kv-cache",
            "fp8",
            "--dtype",
            dtype,
            "--calib-size",
            "16",
            "--seq-len",
            "64",
            "--out",
            str(tmp_path / "q"),
        ],
        world,
        tmp_path,
        timeout=900 if algorithm == "awq" else 300,  # AWQ's searches, about a minute on one idle core
    )
    assert r.returncode == 0, r.stderr
    got = peaks(r.stderr)
    assert len(got) == world, r.stderr
    for measured, planned in got:
        assert abs(measured - planned) <= 0.15 * measured, [line for line in r.stderr.splitlines() if "memory" in line]


def test_a_run_over_max_memory_is_refused_before_loading_naming_what_fits(ckpt, tmp_path):
    r = ptq(
        [
            ckpt,
            "--recipe",
            "nvfp4",
            "--dtype",
            "fp32",
            "--calib-size",
            "4096",
            "--seq-len",
            "256",
            "--max-memory",
            "1GiB",
            "--out",
            str(tmp_path / "q"),
        ],
        1,
        tmp_path,
    )
    assert r.returncode == 2
    line = r.stderr.strip().splitlines()[-1]
    assert re.fullmatch(
        r"error: rank 0 would peak at [\d.]+ GiB .* over --max-memory 1.00 GiB: use --calib-size \d+", line
    ), line
    assert not os.path.exists(tmp_path / "q")


def test_the_refusal_names_the_smallest_ep_and_the_largest_calib_size_that_fit(ckpt):
    with Checkpoint(ckpt) as ck:
        planner = Planner.of(ResolvedCheckpoint.of(ck, torch.float32), torch.device("cpu"))

        def shape(ep, n):
            return RunShape(rank=0, world=4, ep=ep, num_sequences=n, seq_len=256, step_sequences=4, group_tokens=512)

        def peak(ep, n):
            return planner.plan(shape(ep, n), baseline=0).peak

        limit = peak(1, 16)  # at ep 1, 16 sequences fit and 64 do not; ep 2 halves the largest layer
        assert peak(2, 64) <= limit < peak(1, 64)
        with pytest.raises(ConfigError) as e:
            check_memory(planner, planner.plan(shape(1, 64), baseline=0), limit, shape(1, 64), num_experts=16)
    m = re.search(r"use --ep (\d+) or --calib-size (\d+)$", str(e.value))
    assert m, str(e.value)
    assert int(m.group(1)) == 2
    fits = int(m.group(2))
    assert 16 <= fits < 64 and peak(1, fits) <= limit < peak(1, fits + 1)


def gptq_planner(ck: Checkpoint, fmt: str, device: str) -> Planner:
    """The plan of a recipe that runs GPTQ in `fmt` on every Linear it quantizes."""
    rc = ResolvedCheckpoint.of(ck, torch.float32)
    return program_of(*plan_recipe(rc, fmt, None, "gptq")).planner(rc, torch.device(device))


def test_gptq_codes_are_planned_at_their_formats_size_on_the_device_or_on_the_host(ckpt):
    """NVFP4's codes pack two weights a byte, FP8's take one; a CPU rank holds them in its one plan,
    a GPU rank on the host, beside the process (not on the device)."""
    shape = RunShape(rank=0, world=2, ep=2, num_sequences=16, seq_len=64, step_sequences=2, group_tokens=512)
    with Checkpoint(ckpt) as ck:
        _, targets = plan_recipe(ResolvedCheckpoint.of(ck, torch.float32), "fp8")
        dense = sum(
            math.prod(ck.meta(n).shape)
            for n in ck.names()
            if n.rpartition(".")[0] in targets and not n.endswith(("w13", "w2"))
        )
        experts = sum(
            math.prod(ck.meta(n).shape)
            for n in ck.names()
            if n.rpartition(".")[0] in targets and n.endswith(("w13", "w2"))
        )
        fp8 = gptq_planner(ck, "fp8", "cpu").plan(shape, baseline=0)
        nvfp4 = gptq_planner(ck, "nvfp4", "cpu").plan(shape, baseline=0)
        gpu = gptq_planner(ck, "nvfp4", "cuda").plan(shape, baseline=0, host_baseline=100 * MiB)
    assert fp8.kept == dense + experts // 2  # a byte a weight, this rank's half of the experts
    assert nvfp4.kept == fp8.kept // 2 and nvfp4.host is None
    assert gpu.kept == 0 and gpu.host.kept == (("GPTQ's codes", nvfp4.kept),)
    assert gpu.host.peak == 100 * MiB + gpu.tokens + gpu.host.reading + gpu.host.ahead + gpu.host.saved + nvfp4.kept
    assert gpu.host.ahead == gpu.layer  # the next layer, read ahead while one computes
    assert gpu.host.saved == gpu.hidden  # a save's copy of the hidden states on the host


def test_a_gpu_rank_over_the_hosts_memory_is_refused_naming_the_setting_and_the_ep_that_fits(ckpt):
    """The host is shared: its ranks' host plans together are checked against --max-host-memory, and
    a larger ep, which splits the experts' codes, is named where it fits."""
    with Checkpoint(ckpt) as ck:
        planner = gptq_planner(ck, "fp8", "cuda")

        def shape(ep):
            return RunShape(rank=0, world=4, ep=ep, num_sequences=16, seq_len=64, step_sequences=4, group_tokens=512)

        def host(ep):
            return planner.plan(shape(ep), baseline=0, host_baseline=0).host.peak

        limit = 4 * host(2)
        assert limit < 4 * host(1)
        check_host_memory(planner, planner.plan(shape(2), baseline=0), limit, shape(2), 16, ranks_on_host=4)
        with pytest.raises(ConfigError) as e:
            check_host_memory(planner, planner.plan(shape(1), baseline=0), limit, shape(1), 16, ranks_on_host=4)
    assert re.fullmatch(
        r"rank 0 would hold [\d.]+ MiB of host memory \(process 0 B, token ids .*, GPTQ's codes "
        r"[\d.]+ MiB\); with the 4 ranks on its host, [\d.]+ [MG]iB, over --max-host-memory [\d.]+ [MG]iB: "
        r"use --ep 2, or fewer ranks on each host, or a host with more memory free",
        str(e.value),
    )


@pytest.mark.cuda
def test_a_gpu_run_over_the_hosts_memory_is_refused_before_reading_data(ckpt, tmp_path):
    r = ptq(
        [
            ckpt,
            "--recipe",
            "nvfp4",
            "--algorithm",
            "gptq",
            "--max-host-memory",
            "1MiB",
            "--calib",
            "missing",
            "--out",
            str(tmp_path / "q"),
        ],
        1,
        tmp_path,
    )
    assert r.returncode == 2
    assert re.fullmatch(
        r"error: rank 0 would hold .* of host memory \(.*\); with the 1 ranks on its host, .*, over "
        r"--max-host-memory 1.00 MiB: use .*",
        r.stderr.strip().splitlines()[-1],
    ), r.stderr
    assert not os.path.exists(tmp_path / "q")


def test_gptq_solves_as_many_experts_at_a_time_as_the_memory_allows(ckpt):
    """The expert stack is the largest that keeps the plan within the limit (at least one, at most
    MOST_EXPERTS_STACKED, the most where no limit is known): each expert added costs its solve."""
    shape = RunShape(rank=0, world=1, ep=1, num_sequences=16, seq_len=64, step_sequences=1, group_tokens=512)
    with Checkpoint(ckpt) as ck:
        planner = gptq_planner(ck, "nvfp4", "cpu")
        unlimited = planner.plan(shape, baseline=0)
        one = planner.plan(shape, baseline=0, limit=1)  # nothing fits: still one at a time
        step = planner.plan(shape, baseline=0, limit=one.peak + 1).peak - one.peak  # nothing more fits yet
        limit = one.peak + (unlimited.peak - one.peak) // 2
        half = planner.plan(shape, baseline=0, limit=limit)
    assert unlimited.expert_stack == MOST_EXPERTS_STACKED == 16 and one.expert_stack == 1 and step == 0
    assert 1 < half.expert_stack < 16 and half.peak <= limit
    per_expert = (unlimited.peak - one.peak) // 15
    assert half.peak + per_expert > limit
    assert f"GPTQ's Hessians {format_bytes(half.held)} (experts solved {half.expert_stack} at a time)" in half.terms()


def storage_bytes(tensors) -> int:
    """The bytes of the distinct storages `tensors` keep alive (a view keeps its whole storage)."""
    return sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}.values())


def test_the_plan_counts_what_awq_holds(tmp_path, monkeypatch):
    """The plan of an AWQ run grows by what AWQ holds: the samples its search reads, exactly as
    many bytes as the run keeps (its dense readers' inputs, the routed rows and activations, at
    one rank), its search's working set, and the clips' steps the run keeps to its end (exactly
    those it holds and writes), over what the same run without AWQ plans."""
    hf = make_tiny("qwen3_moe", str(tmp_path / "hf"), dtype="fp32")
    ck_dir = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    held, plans, kept = [], [], []
    reference, plan_run, write = AWQ.reference, ptq_module.plan_run, ptq_module.write_calibrated

    def measured(self, layer):
        samples = [t for ts in self.dense.values() for t in ts]
        samples += [t for s in self.experts.values() for ts in (*s.x, *s.h) for t in ts]
        held.append(storage_bytes(samples))
        return reference(self, layer)

    def planned(*args, **kw):
        plans.append(plan_run(*args, **kw))
        return plans[-1]

    def written(*args, **kw):
        kept.append(kw["parts"]["awq"])  # the run's folds, as it holds them at its end
        return write(*args, **kw)

    monkeypatch.setattr(AWQ, "reference", measured)
    monkeypatch.setattr(ptq_module, "plan_run", planned)
    monkeypatch.setattr(ptq_module, "write_calibrated", written)
    a = PTQArgs(ck_dir, "nvfp4", str(tmp_path / "q"), calib_size=4, seq_len=32, eval_size=0, algorithm="awq")
    run_ptq(ParallelState.single(), a)
    with Checkpoint(a.out) as q:  # the clips' steps, as the run wrote them
        clips = sum(q.read(n).nbytes for n in q.names(role="calibration") if n.endswith("_clip"))
    (folds,) = kept
    assert storage_bytes(t for n, t in folds.tensors().items() if n.endswith("_clip")) == clips
    ((plan, _),) = plans
    with Checkpoint(ck_dir) as ck:
        rc = ResolvedCheckpoint.of(ck, torch.bfloat16)  # the run's dtype
        recipe, targets = plan_recipe(rc, "nvfp4", None, "awq")
        shape = ptq_module.run_shape(a, ParallelState.single(), ck.config)
        without = Planner.of(rc, torch.device("cpu"), targets).plan(shape, baseline=0)
        awq = program_of(recipe, targets).planner(rc, torch.device("cpu"))
        with_awq = awq.plan(shape, baseline=0)
        T, K = a.seq_len, ck.config.num_experts_per_tok
        (memory,) = awq.algorithms
        each = [
            awq_bytes({i: layer}, a.calib_size * T, a.calib_size * T * K, T, 2, 1, heap_keeps=True)
            for i, layer in memory.layers.items()
        ]
    assert [samples for samples, *_ in each] == held  # every layer's, to the byte
    assert sum(layer_clips for *_, layer_clips in each) == clips > 0
    most = max(samples + search for samples, search, _ in each)
    assert plan.held == with_awq.held == most + clips > max(held) + clips
    assert with_awq.peak - without.peak == with_awq.held


def test_gptq_plans_the_tables_its_column_rounding_holds_for_block_scaled_formats():
    """A solve's plan grows, over the plan without a format, by exactly what GPTQ's column rounding
    of each block-scaled format holds (the export's grid and the fp32 scale of each element's
    block), a partial FP8 block at the edge included; NVFP4's column rounding holds no such table."""
    w = torch.randn(1, 300, 256)
    for name, fmt in WEIGHT_FORMATS.items():
        planned = GPTQLinear.of(1, 300, 256, False, name).weight_solve - GPTQLinear.of(1, 300, 256, False).weight_solve
        cols = columns_of(name, w, torch.ones(1))
        held = storage_bytes([cols.row_scales, *cols.grids]) if isinstance(fmt, ScaledByBlocks) else 0
        assert planned == held, name
    assert GPTQLinear.of(1, 300, 256, False, "mxfp4").weight_solve > GPTQLinear.of(1, 300, 256, False).weight_solve
