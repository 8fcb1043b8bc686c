"""The dry run's time estimate: its steps per layer kind are the ones the run counts, and its
seconds are those steps at the probe's measured times (no timing is asserted: bench/estimate.py
measures how close it comes)."""

import math

import pytest
import torch

from eprt.hf.convert import convert_hf
from eprt.models.moe import MoE
from eprt.models.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.engine import LayerEngine
from eprt.quant.estimate import estimate_time
from eprt.quant.ptq import PTQArgs, plan_recipe, run_ptq, run_shape
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("estimate")
    return convert_hf(make_tiny("qwen3_moe", str(root / "hf"), dtype="fp32"), str(root / "ck"), progress=False)


@pytest.mark.parametrize("algorithm", ["max", "gptq"])
def test_estimate_counts_the_steps_the_run_counts_per_layer_kind(ck, tmp_path, monkeypatch, algorithm):
    a = PTQArgs(
        ck, "nvfp4", str(tmp_path / "q"), algorithm=algorithm, dtype="fp32", calib_size=9, seq_len=24, group_tokens=48
    )
    state = ParallelState.single("cpu")
    with Checkpoint(ck) as opened:
        rc = ResolvedCheckpoint.of(opened, torch.float32)
        recipe, targets = plan_recipe(rc, a.recipe, a.kv_cache, a.algorithm)
        estimate = estimate_time(
            state, rc, recipe, targets, run_shape(a, state, opened.config), kv=False, expert_stack=16
        )

    counted: dict[int, tuple[bool, int]] = {}  # the run's layers: (MoE, steps the bar counted)
    run_layer = LayerEngine.run_layer

    def counting(self, i, ls, pb):
        before = pb.n
        ls = run_layer(self, i, ls, pb)
        counted[i] = isinstance(self.decoder.layers[i].ffn(), MoE), pb.n - before
        return ls

    monkeypatch.setattr(LayerEngine, "run_layer", counting)
    monkeypatch.setenv("RANK", "0")  # the bar counts on rank 0
    run_ptq(state, a)

    runs = 3 if algorithm == "gptq" else 1  # the statistics run; GPTQ's Hessian and quantized runs
    steps = 5 * runs  # 9 sequences in groups of 2 (48 tokens of 24), one group a step
    kinds = {k.kind.name: (k.kind.layers, k.kind.steps) for k in estimate.kinds}
    assert kinds == {"MoE": ((0, 2), steps), "dense-MLP": ((1,), steps)}
    assert counted == {0: (True, steps), 1: (False, steps), 2: (True, steps)}
    assert all(k.step_s > 0 and k.layer_s >= 0 for k in estimate.kinds)
    assert (estimate.exchange_s, estimate.exchange_steps) == (0, 0)  # a world of one exchanges nothing
    assert estimate.seconds == pytest.approx(
        sum(len(k.kind.layers) * (k.kind.steps * k.step_s + k.layer_s) for k in estimate.kinds)
    )
    assert math.isfinite(estimate.seconds)
