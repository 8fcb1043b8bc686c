"""`--algorithm max|mse` and a recipe rule's `algorithm`: how weight scales are chosen, recorded
in the calibrated checkpoint, refused by name when unknown."""

import json
import os
import subprocess
import sys

import pytest
import torch

from eprt.errors import ConfigError
from eprt.hf.convert import convert_hf
from eprt.parallel import ParallelState
from eprt.quant.ptq import PTQArgs, run_ptq
from eprt.quant.recipe import ALGORITHMS, load_recipe, parse_recipe
from eprt.testing.tiny import make_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen")
    return convert_hf(make_tiny("qwen3_moe", str(d / "hf")), str(d / "ck"), progress=False)


# --- the recipe's algorithm and the flag ---------------------------------------------------------

def test_a_rule_names_its_algorithm_and_the_others_take_the_default():
    d = {"name": "r", "quantize": [{"pattern": "*.experts", "format": "nvfp4", "algorithm": "mse"},
                                   {"pattern": "*.lm_head", "format": "none"},
                                   {"pattern": "*", "format": "fp8"}]}
    r = parse_recipe(d, "r.yaml")
    assert r.algorithm_of("model.layers.1.mlp.experts") == "mse"
    assert r.algorithm_of("model.layers.1.self_attn.q_proj") == "max"  # the default
    assert r.algorithm_of("model.lm_head") is None  # not quantized
    assert r.algorithms == ["max", "mse"]
    assert parse_recipe(d, "r.yaml", algorithm="mse").algorithms == ["mse"]
    # what the calibrated checkpoint records reads back as the same recipe, whatever the default then
    assert parse_recipe(r.to_json(), "q", algorithm="mse") == r
    assert load_recipe("nvfp4", algorithm="mse").algorithm_of("model.layers.0.mlp.experts") == "mse"


@pytest.mark.parametrize("d, algorithm, message", [
    ({"quantize": [{"pattern": "*", "format": "nvfp4", "algorithm": "awq"}]}, None,
     "r.yaml: quantize[0] algorithm 'awq': unknown algorithm; choose one of max, mse, gptq"),
    ({"quantize": [{"pattern": "*", "format": "nvfp4"}]}, "awq",
     "--algorithm 'awq': unknown algorithm; choose one of max, mse, gptq"),
])
def test_an_unknown_algorithm_is_refused_by_name_with_the_choices(d, algorithm, message):
    with pytest.raises(ConfigError) as e:
        parse_recipe(d, "r.yaml", algorithm=algorithm)
    assert str(e.value) == message


def test_the_flag_refuses_an_unknown_algorithm_with_the_choices(qwen):
    r = subprocess.run([sys.executable, "tools/ptq.py", qwen, "--dry-run", "--recipe", "nvfp4", "--algorithm", "awq"],
                       cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2
    assert "--algorithm: invalid choice: 'awq' (choose from " + ", ".join(map(repr, ALGORITHMS)) + ")" in r.stderr


def test_the_calibrated_checkpoint_records_the_algorithm(qwen, tmp_path):
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(qwen, "nvfp4_experts_fp8_attention", q, calib_size=2, seq_len=8,
                                            algorithm="mse", progress=False))
    quant = json.load(open(os.path.join(q, "eprt.json")))["quantization"]
    assert quant["calibration"]["algorithm"] == "mse"
    assert {r["algorithm"] for r in quant["recipe"]["quantize"]} == {"mse"}


def test_a_run_resumes_only_from_a_run_with_its_own_algorithm(qwen):
    from eprt.quant.ptq import fingerprint
    from eprt.storage.checkpoint import Checkpoint

    samples = torch.zeros(2, 8, dtype=torch.int64)
    with Checkpoint(qwen) as ck:
        prints = [fingerprint(ck, PTQArgs(qwen, "nvfp4", "q", algorithm=a), ParallelState.single(), samples)
                  for a in ALGORITHMS]
    assert len({json.dumps(p, sort_keys=True) for p in prints}) == len(ALGORITHMS)
