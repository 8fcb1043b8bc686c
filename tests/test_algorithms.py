"""The contract every registered algorithm keeps, and every sequence of them a rule may name
(eprt.quant.algorithms.registry): the dry run plans the memory the run plans (its own terms
included), a tiny run writes a calibrated checkpoint whose record and work files are its own, and a
run stopped at a layer boundary resumes to the same export bytes. The time estimate runs the same program
(tests/test_estimate.py, over the same sequences)."""

import dataclasses
import json
import os
import sys

import pytest
import torch
from safetensors.torch import load_file

from eprt.commands.ptq import ptq
from eprt.errors import ConfigError
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.algorithms.registry import ALGORITHMS as REGISTERED
from eprt.quant.algorithms.registry import GPTQParams, GPTQRunOptions, option_flags, params_of, steps
from eprt.quant.calibrated import DENSE_FILE
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.recipe import ALGORITHMS, Rule, parse_recipe
from eprt.quant.run.args import CALIBRATION_SETTINGS
from eprt.quant.run.fingerprint import OPTIONS
from eprt.quant.run.planner import Planner
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.ep_checks import same_files

SIZES = {"calib_size": 6, "seq_len": 16, "eval_size": 0}
# the algorithms that hold memory of their own (a term of the plan: eprt.quant.run.memory_plan.AlgorithmTerm)
# and keep a state a layer boundary saves
OWN_TERM = {"gptq", "awq"}


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("algorithms")
    return convert_hf(make_tiny("qwen3_moe", str(root / "hf"), dtype="fp32"), str(root / "ck"), progress=False)


def test_every_registered_algorithm_is_a_sequence_a_rule_may_name():
    assert set(REGISTERED) <= set(ALGORITHMS)
    assert all(set(steps(s)) <= set(REGISTERED) for s in ALGORITHMS)


def planned(monkeypatch) -> list:
    """Every memory plan made from here on, as made."""
    plans, plan = [], Planner.plan

    def recording(self, *args, **kw):
        plans.append(plan(self, *args, **kw))
        return plans[-1]

    monkeypatch.setattr(Planner, "plan", recording)
    return plans


def dry_run(monkeypatch, ck, algorithm):
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in SIZES.items()]
    argv = ["eprt-ptq", ck, "--dry-run", "--recipe", "nvfp4", "--algorithm", algorithm, "--dtype", "fp32", *flags]
    monkeypatch.setattr(sys, "argv", argv)
    assert ptq() == 0


def args(ck, out, algorithm, **kw):
    return PTQArgs(ck, "nvfp4", out, algorithm=algorithm, dtype="fp32", progress=False, **SIZES, **kw)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_the_dry_run_plans_the_memory_the_run_plans(ck, tmp_path, monkeypatch, algorithm):
    plans = planned(monkeypatch)
    dry_run(monkeypatch, ck, algorithm)
    run_ptq(ParallelState.single("cpu"), args(ck, str(tmp_path / "q"), algorithm))
    dry, run = (dataclasses.replace(p, baseline=0) for p in plans)  # the process's size is measured when planned
    assert dry == run
    own = {a for a in steps(algorithm) if a in OWN_TERM}
    assert {t.name for t in run.algorithms if t.held} == own


def stopped_after_layer_1(monkeypatch):
    run_layer = LayerEngine.run_layer

    def stopping(self, i, ls, pb):
        if i == 2:
            raise RuntimeError("stopped")
        return run_layer(self, i, ls, pb)

    monkeypatch.setattr(LayerEngine, "run_layer", stopping)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_a_run_stopped_at_a_layer_boundary_resumes_to_the_same_export(ck, tmp_path, monkeypatch, algorithm):
    state = ParallelState.single("cpu")
    whole, out = str(tmp_path / "whole"), str(tmp_path / "q")
    run_ptq(state, args(ck, whole, algorithm))
    with monkeypatch.context() as m:
        stopped_after_layer_1(m)
        with pytest.raises(Exception, match="stopped"):
            run_ptq(state, args(ck, out, algorithm))
    rank = os.path.join(out + ".work", "rank-00000")
    # the last boundary, and of each algorithm that keeps a state a file a layer (named after it),
    # each holding what that layer gained and nothing an earlier one saved
    kept = [a for a in steps(algorithm) if a in OWN_TERM]
    assert sorted(os.listdir(rank)) == sorted(
        ["layer-00001.safetensors", *(f"{a}-0000{i}.safetensors" for a in kept for i in (0, 1))]
    )
    for a in kept:
        first, second = (set(load_file(os.path.join(rank, f"{a}-0000{i}.safetensors"))) for i in (0, 1))
        assert first and second and not first & second
    assert run_ptq(state, args(ck, out, algorithm, resume=True))["resumed_after"] == 1
    for d in (whole, out):
        export_hf(d, d + "-hf", progress=False)
    assert same_files(whole + "-hf", out + "-hf")


def rule(algorithm):
    return parse_recipe({"quantize": [{"pattern": "*", "format": "nvfp4", "algorithm": algorithm}]}, "r.yaml").rules[0]


@pytest.mark.parametrize(
    "spelling",
    ["awq+gptq", ["awq", "gptq"], ["awq", {"gptq": {"block": 128, "damp": 0.01}}], [{"awq": {}}, "gptq"]],
)
def test_a_sequence_in_any_spelling_is_the_recipe_the_old_spelling_makes(spelling):
    """Parameters at their defaults are no parameters: the recipe, and what a calibrated checkpoint
    records of it, are the old spelling's."""
    assert rule(spelling) == rule("awq+gptq") == Rule("*", "nvfp4", "awq+gptq")
    recorded = parse_recipe({"quantize": [{"pattern": "*", "format": "nvfp4", "algorithm": spelling}]}, "r").to_json()
    assert recorded["quantize"] == [{"pattern": "*", "format": "nvfp4", "algorithm": "awq+gptq"}]


def test_parameters_a_rule_sets_are_typed_recorded_and_read_back():
    r = parse_recipe(
        {"quantize": [{"pattern": "*", "format": "nvfp4", "algorithm": ["awq", {"gptq": {"damp": 1}}]}]}, "r"
    )
    assert r.rules[0] == Rule("*", "nvfp4", "awq+gptq", (("gptq", (("damp", 1.0),)),))
    assert params_of("gptq", r.params_of("model.layers.0.mlp.experts")) == GPTQParams(block=128, damp=1.0)
    assert params_of("awq", r.params_of("model.layers.0.mlp.experts")) is None  # AWQ takes none
    assert r.to_json()["quantize"] == [
        {"pattern": "*", "format": "nvfp4", "algorithm": ["awq", {"gptq": {"damp": 1.0}}]}
    ]
    assert parse_recipe(r.to_json(), "again") == dataclasses.replace(r, name="r")


@pytest.mark.parametrize(
    "algorithm, message",
    [
        ("gptq+awq", r"'gptq\+awq': unknown algorithm; choose one of max, mse, gptq, awq, awq\+gptq"),
        (["awq", "mse"], r"\['awq', 'mse'\]: unknown algorithm; choose one of max, mse, gptq, awq, awq\+gptq"),
        ({"gptq": {"blocks": 64}}, "gptq: unknown parameter 'blocks'; its parameters are block, damp"),
        ({"gptq": {"block": 12.5}}, r"gptq block 12.5: give a positive int \(default 128\)"),
        ({"gptq": {"damp": -0.1}}, r"gptq damp -0.1: give a positive float \(default 0.01\)"),
        ({"gptq": {"damp": True}}, r"gptq damp True: give a positive float"),
        ({"awq": {"alpha": 0.5}}, "awq: unknown parameter 'alpha'; its parameters are none"),
        ({"smoothquant": {}}, "unknown algorithm 'smoothquant'; choose one of max, mse, gptq, awq"),
        (7, "7: name an algorithm, a list of them or"),
    ],
)
def test_a_rule_naming_what_no_algorithm_takes_is_refused_by_name(algorithm, message):
    with pytest.raises(ConfigError, match=r"r.yaml: quantize\[0\] algorithm.*" + message):
        rule(algorithm)


def test_a_rules_parameters_reach_its_algorithm(ck, tmp_path):
    """GPTQ's damping from the rule: another damping, other codes; the default's, the default's bytes."""
    recipe = tmp_path / "r.yaml"
    written = {}
    for name, algorithm in (
        ("plain", "gptq"),
        ("default", {"gptq": {"damp": 0.01}}),
        ("damped", {"gptq": {"damp": 10}}),
    ):
        recipe.write_text(
            json.dumps({"name": "r", "quantize": [{"pattern": "*", "format": "nvfp4", "algorithm": algorithm}]})
        )
        out = str(tmp_path / name)
        run_ptq(ParallelState.single("cpu"), dataclasses.replace(args(ck, out, "max"), recipe=str(recipe)))
        written[name] = load_file(os.path.join(out, DENSE_FILE))
    codes = lambda name: {n: t for n, t in written[name].items() if n.endswith(".gptq_weight")}  # noqa: E731
    assert codes("plain") and all(torch.equal(t, codes("default")[n]) for n, t in codes("plain").items())
    assert any(not torch.equal(t, codes("damped")[n]) for n, t in codes("plain").items())


def test_an_algorithms_run_option_is_a_flag_the_run_fingerprints(ck, tmp_path, monkeypatch):
    """GPTQ's --gptq-min-tokens, declared by its registry entry: a PTQArgs field with the option's
    default, a calibration setting, and part of what a saved layer boundary is resumed under."""
    assert option_flags() == {"gptq_min_tokens": "--gptq-min-tokens"}
    assert PTQArgs.__dataclass_fields__["gptq_min_tokens"].default == GPTQRunOptions().min_tokens
    assert "gptq_min_tokens" in CALIBRATION_SETTINGS and OPTIONS["gptq_min_tokens"] == "--gptq-min-tokens"
    state, out = ParallelState.single("cpu"), str(tmp_path / "q")
    with monkeypatch.context() as m:
        stopped_after_layer_1(m)
        with pytest.raises(Exception, match="stopped"):
            run_ptq(state, args(ck, out, "gptq"))
    with pytest.raises(Exception, match=r"--gptq-min-tokens \(128, now 1\)"):
        run_ptq(state, args(ck, out, "gptq", resume=True, gptq_min_tokens=1))
    assert run_ptq(state, args(ck, out, "gptq", resume=True))["resumed_after"] == 1
