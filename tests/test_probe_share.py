"""The time probe runs one rank's share of a layer, planned like the run: its routed experts (E/ep) and
its sequences of a step (1/world), so that at real size it fits the GPU the run fits on."""

import math
import os
import re
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from bench.scale import REAL, RELEASE, TINY_DIMS, inflate, make_config
from eprt.families import parse_hf_config
from eprt.hf.convert import convert_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.quant.algorithms.program import program_of
from eprt.quant.loop.sequences import own_sequences
from eprt.quant.run.estimate import PROBE_STEPS, ProbeEngine, probe_time
from eprt.quant.run.memory_plan import RunShape
from eprt.quant.run.planner import Planner
from eprt.quant.run.probe_share import RankShare, plan_probe
from eprt.quant.run.setup import plan_recipe
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from eprt.units import parse_size

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU_MEMORY = 80 * 10**9  # an 80 GB GPU


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("probe")
    return convert_hf(make_tiny("qwen3_moe", str(root / "hf"), dtype="fp32"), str(root / "ck"), progress=False)


def test_the_probe_holds_one_ranks_experts_and_sequences(tiny, monkeypatch):
    """On a world of 4 at ep 4, the probe's MoE layers hold E/4 experts, its steps 1/4 of a step's
    sequences, and every held expert computes rows."""
    shape = RunShape(0, 4, 4, num_sequences=64, seq_len=24, step_sequences=8, group_tokens=48)
    seen = {}
    run_layer = ProbeEngine.run_layer

    def spying(self, i, ls, pb):
        experts = next((m for n, m in self.model.named_modules() if n.endswith(f"layers.{i}.mlp.experts")), None)
        if experts is not None:
            rows = []
            forward_units = experts.forward_units
            experts.forward_units = lambda x, per_unit: rows.append(per_unit.sum(1)) or forward_units(x, per_unit)
        ls = run_layer(self, i, ls, pb)
        if experts is not None:
            seen[i] = (experts.count, ls.hidden.shape[0], torch.stack(rows).sum(0))
        return ls

    monkeypatch.setattr(ProbeEngine, "run_layer", spying)
    with Checkpoint(tiny) as ck:
        rc = ResolvedCheckpoint.of(ck, torch.float32)
        program = program_of(*plan_recipe(rc, "nvfp4", None, "max"))
        estimate = probe_time(rc, torch.device("cpu"), program, shape, expert_stack=16)
        E = ck.config.num_experts
    assert seen and all(count == E // 4 for count, _, _ in seen.values())
    assert all(n == PROBE_STEPS * math.ceil(8 / 4) for _, n, _ in seen.values())
    assert all(bool((rows > 0).all()) and len(rows) == E // 4 for _, _, rows in seen.values())
    assert all(k.step_s > 0 and k.read_s > 0 for k in estimate.kinds)


def test_a_run_of_fewer_steps_than_the_probe_is_probed_whole():
    """A step is at least one work-unit group (16 sequences of 128 tokens at group_tokens 2048): a run
    of 32 sequences makes two, and the probe runs those two, not PROBE_STEPS steps of 16 (what a
    layer does once over all its sequences, AWQ's search, is then timed over the run's count); a
    run of more steps is probed over PROBE_STEPS of them."""
    shape = RunShape(0, 1, 1, num_sequences=32, seq_len=128, step_sequences=1, group_tokens=2048)
    share = RankShare(shape, PROBE_STEPS)
    assert (share.schedule.num_sequences, share.schedule.num_steps) == (32, 2)
    assert share.plan_shape == shape
    longer = RankShare(replace(shape, num_sequences=320), PROBE_STEPS)
    assert (longer.schedule.num_sequences, longer.schedule.num_steps) == (PROBE_STEPS * 16, PROBE_STEPS)
    split = RankShare(replace(shape, world=2, num_sequences=20), PROBE_STEPS)  # rank 0 runs 10 of them
    assert split.schedule.num_sequences == len(own_sequences(20, 0, 2)) == 10


def test_the_probes_plan_is_the_runs_at_its_sequences(tiny):
    shape = RunShape(1, 4, 2, num_sequences=64, seq_len=24, step_sequences=8, group_tokens=48)
    share = RankShare(shape, PROBE_STEPS)
    with Checkpoint(tiny) as ck:
        planner = Planner.of(ResolvedCheckpoint.of(ck, torch.float32), torch.device("cpu"))
        probe, run = plan_probe(planner, share, 0, 0, None), planner.plan(shape, 0)
        assert probe == planner.plan(share.plan_shape, 0)
        assert (probe.layer, probe.step) == (run.layer, run.step)  # a rank's weights and step buffers
        assert probe.hidden == PROBE_STEPS * 2 * 24 * ck.config.hidden_size * 4 < run.hidden  # 2 of a step's 8
        with pytest.raises(Exception, match=r"the time probe of rank 1 would peak at .* --chunk-size"):
            plan_probe(planner, share, 0, 0, probe.peak - 1)


# the two largest releases of the DeepSeek-V3 architecture (each run: a dry run of 8 ranks at real dims)
@pytest.fixture(scope="module", params=["deepseek_v3", "kimi_k2"])
def real_dims(request, tmp_path_factory):
    """The model's real dims and expert count (bench/scale.py's file holes, its family's tiny config
    filling in the rest), with 4 layers and the MTP layers; nothing reads a weight."""
    model = request.param
    root = tmp_path_factory.mktemp(model)
    real = {**REAL[model], "num_hidden_layers": 4, "first_k_dense_replace": 1}
    family = RELEASE[model][0]
    hf = make_tiny(family, str(root / "hf"), **{**real, **TINY_DIMS[family]})
    ck = convert_hf(hf, str(root / "ck"), progress=False)
    config = {**make_config(hf), **real}
    inflate(ck, config, str(root / "real"))
    return model, str(root / "real"), parse_hf_config(config).num_experts


def test_real_size_dry_runs_plan_a_probe_that_fits_an_80_gb_gpu(real_dims):
    """Every bench/scale.py model at world 8 with GPTQ and the quality report: the probe once held every
    routed expert and a whole step (124-289 GiB for DeepSeek-V3 and Kimi-K2); one rank's share fits
    beside the run's own plan."""
    model, ck, num_experts = real_dims
    r = subprocess.run(
        [
            *(sys.executable, os.path.join(ROOT, "tools", "ptq.py"), "--nproc-per-node", "8", ck, "--dry-run"),
            *("--device", "cuda", "--recipe", "nvfp4", "--algorithm", "gptq", "--estimate-time"),
            *("--seq-len", "4096", "--calib-size", "512", "--max-memory", "80GB"),
        ],
        capture_output=True,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    m = re.search(
        r"time probe on cuda: rank 0's share \((\d+) routed experts of a layer, [23] steps of (\d+) sequences\) "
        r"peaks at ([\d.]+ \w+) \(",
        r.stdout,
    )
    assert m, r.stdout
    assert int(m.group(1)) == num_experts // 8
    assert 0 < parse_size(m.group(3)) <= GPU_MEMORY
    assert "memory plan on cuda: rank 0 peaks at" in r.stdout
