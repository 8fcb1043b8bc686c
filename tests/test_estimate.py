"""The dry run's time estimate: its steps per layer kind are the ones the run counts, and its
seconds are those steps at the probe's measured times (no timing is asserted: bench/estimate.py
measures how close it comes)."""

import math
import os

import pytest
import torch

from eprt.hf.convert import convert_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.algorithms.program import program_of
from eprt.quant.algorithms.registry import steps as steps_of
from eprt.quant.algorithms.registry import unrotated
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.recipe import ALGORITHMS
from eprt.quant.run.estimate import estimate_time
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.run.setup import plan_recipe, run_shape
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("estimate")
    return convert_hf(make_tiny("qwen3_moe", str(root / "hf"), dtype="fp32"), str(root / "ck"), progress=False)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_estimate_counts_the_steps_the_run_counts_per_layer_kind(ck, tmp_path, monkeypatch, algorithm):
    """Every algorithm a rule may name, AWQ's and awq+gptq's included: the probe runs the run's program."""
    a = PTQArgs(
        ck, "nvfp4", str(tmp_path / "q"), algorithm=algorithm, dtype="fp32", calib_size=9, seq_len=24, group_tokens=48
    )
    state = ParallelState.single("cpu")
    with Checkpoint(ck) as opened:
        rc = ResolvedCheckpoint.of(opened, torch.float32)
        recipe, targets = plan_recipe(rc, a.recipe, a.kv_cache, a.algorithm)
        estimate = estimate_time(
            state,
            rc,
            program_of(recipe, targets),
            run_shape(a, state, opened.config),
            expert_stack=16,
            work_dir=str(tmp_path / "q.work"),
            save_bytes=2**20,
        )
    assert (
        os.listdir(tmp_path) == []
    )  # the saves were timed in the work directory's file system, which is left as it was

    counted: dict[int, tuple[bool, int]] = {}  # the run's layers: (MoE, steps the bar counted)
    run_layer = LayerEngine.run_layer

    def counting(self, i, ls, pb):
        before = pb.n
        ls = run_layer(self, i, ls, pb)
        counted[i] = self.decoder.layers[i].routed is not None, pb.n - before
        return ls

    monkeypatch.setattr(LayerEngine, "run_layer", counting)
    monkeypatch.setenv("RANK", "0")  # the bar counts on rank 0
    run_ptq(state, a)

    # the statistics run; GPTQ's Hessian and quantized runs; AWQ's run of the folded layer
    runs = {"max": 1, "mse": 1, "gptq": 3, "awq": 2, "awq+gptq": 4}[
        unrotated(algorithm)
    ]  # the rotation is a view: no run
    steps = 5 * runs  # 9 sequences in groups of 2 (48 tokens of 24), one group a step
    kinds = {k.kind.name: (k.kind.layers, k.kind.steps) for k in estimate.kinds}
    assert kinds == {"MoE": ((0, 2), steps), "dense-MLP": ((1,), steps)}
    assert counted == {0: (True, steps), 1: (False, steps), 2: (True, steps)}
    assert all(k.step_s > 0 and k.layer_s >= 0 and k.read_s > 0 for k in estimate.kinds)
    # AWQ's search, once a layer over every sequence, timed apart (the probe's 6 of the run's 9, scaled)
    assert all((k.sequences_s > 0) == ("awq" in steps_of(algorithm)) for k in estimate.kinds)
    assert (estimate.exchange_s, estimate.exchange_steps) == (0, 0)  # a world of one exchanges nothing
    assert estimate.saves == 3 and estimate.save_s > 0  # a save after each layer
    # each save but the last is written while the next layer computes: only what outlasts it is waited
    quickest = min(k.kind.steps * k.step_s + k.layer_s + k.read_s + k.sequences_s for k in estimate.kinds)
    assert estimate.saving_s == pytest.approx(estimate.save_s + 2 * max(0.0, estimate.save_s - quickest))
    assert estimate.seconds == pytest.approx(
        sum(
            len(k.kind.layers) * (k.kind.steps * k.step_s + k.layer_s + k.read_s + k.sequences_s)
            for k in estimate.kinds
        )
        + estimate.saving_s
    )
    assert math.isfinite(estimate.seconds)


def test_mtp_layers_are_a_kind_with_the_steps_the_run_makes_there(tmp_path, monkeypatch):
    """DeepSeek-V3's kinds: its dense first layers, its MoE layers and, when the recipe runs them, its MTP
    layer, which the bar does not count: their steps are the engine's own calls."""
    hf = make_tiny("deepseek_v3", str(tmp_path / "hf"), dtype="fp32")
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    a = PTQArgs(
        ck,
        "nvfp4_experts_fp8_attention_mtp",
        str(tmp_path / "q"),
        algorithm="gptq",
        dtype="fp32",
        calib_size=6,
        seq_len=24,
        group_tokens=48,
        eval_size=0,
    )
    state = ParallelState.single("cpu")
    with Checkpoint(ck) as opened:
        rc = ResolvedCheckpoint.of(opened, torch.float32)
        recipe, targets = plan_recipe(rc, a.recipe, a.kv_cache, a.algorithm)
        estimate = estimate_time(
            state, rc, program_of(recipe, targets), run_shape(a, state, opened.config), expert_stack=16
        )
        moe_layers, num_layers = opened.config.moe_layers, opened.config.num_layers

    steps: dict[str, int] = {}  # the run's step calls: in decoder layers (by kind), in MTP layers
    run_step, run_mtp = LayerEngine._run_step, LayerEngine.run_mtp
    where = []

    def counting_step(self, layer, step, ls, **kw):
        if kw["sequences"] is self.calibration:
            kind = (
                where[-1] if where else "MoE" if list(self.decoder.layers).index(layer) in moe_layers else "dense-MLP"
            )
            steps[kind] = steps.get(kind, 0) + 1
        return run_step(self, layer, step, ls, **kw)

    def in_mtp(self, *args):
        where.append("MTP")
        try:
            return run_mtp(self, *args)
        finally:
            where.pop()

    monkeypatch.setattr(LayerEngine, "_run_step", counting_step)
    monkeypatch.setattr(LayerEngine, "run_mtp", in_mtp)
    run_ptq(state, a)

    kinds = {k.kind.name: len(k.kind.layers) for k in estimate.kinds}
    mine = {k.kind.name: len(k.kind.layers) * k.kind.steps for k in estimate.kinds}
    assert kinds == {"dense-MLP": num_layers - len(moe_layers), "MoE": len(moe_layers), "MTP": 1}
    assert mine == steps
