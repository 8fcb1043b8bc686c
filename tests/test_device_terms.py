"""A GPU rank's plan counts what lies outside torch's allocations (the CUDA context, cuBLAS's workspaces,
NCCL's buffers, which grow with the peers) and the caching allocator's reserve, and prices attention
as SDPA's fused kernels keep it: no T x T scores."""

from dataclasses import replace

import pytest
import torch

from eprt.hf.convert import convert_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.quant.run.device_terms import ALLOCATOR_RESERVE, CUBLAS_WORKSPACES, CUDA_CONTEXT, NCCL_PER_PEER
from eprt.quant.run.memory_plan import RunShape
from eprt.quant.run.planner import Planner
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny

T = 4096


@pytest.fixture(scope="module")
def planners(tmp_path_factory):
    root = tmp_path_factory.mktemp("terms")
    ck = convert_hf(make_tiny("deepseek_v3", str(root / "hf")), str(root / "ck"), progress=False)
    with Checkpoint(ck) as opened:
        rc = ResolvedCheckpoint.of(opened, torch.bfloat16)
        yield Planner.of(rc, torch.device("cuda")), Planner.of(rc, torch.device("cpu")), opened.config


def test_the_gpus_own_terms_grow_with_the_peers(planners):
    gpu, _, _ = planners
    shape = RunShape(0, 1, 1, num_sequences=8, seq_len=T, step_sequences=8, group_tokens=T)
    one = gpu.plan(shape, 0)
    assert one.fixed == CUDA_CONTEXT + CUBLAS_WORKSPACES and one.reserve == ALLOCATOR_RESERVE
    assert one.peak == one.allocated + int(one.allocated * ALLOCATOR_RESERVE) + one.fixed
    eight = gpu.plan(replace(shape, world=8, ep=4), 0)  # peers: 7 in the world, 3 in the ep group, 1 in the edp group
    assert eight.fixed - one.fixed == (7 + 3 + 1) * NCCL_PER_PEER


def test_attention_on_a_gpu_keeps_no_scores(planners):
    gpu, cpu, c = planners
    shape = RunShape(0, 1, 1, num_sequences=1, seq_len=T, step_sequences=1, group_tokens=T)
    on_gpu, on_cpu = gpu.plan(shape, 0), cpu.plan(shape, 0)
    # one sequence's scores as the CPU measured them, against a log-sum-exp per head and query
    assert on_cpu.step - on_gpu.step == 2 * c.num_heads * T * T * 4 - c.num_heads * T * 4
