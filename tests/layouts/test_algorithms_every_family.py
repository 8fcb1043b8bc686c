"""mse, gptq and --calibrate-all-experts on every family: one recipe runs two algorithms by rule
(GPTQ'd NVFP4 routed experts, mse-scaled FP8 attention), with every expert calibrated on every
token, the quality report and the FP8 KV cache, and its export is the same bytes calibrated in
one process or at (world 2, ep 2) with another batch size."""

import json
import os

import pytest

from eprt.storage.checkpoint import Checkpoint
from tests.layouts.rule_runs import assert_same_exports_at_both_layouts, rule_setup
from tests.layouts.test_ptq import FAMILIES

RULES = [
    {"pattern": "*.experts", "format": "nvfp4", "algorithm": "gptq"},
    {"pattern": "*.self_attn.*", "format": "fp8", "algorithm": "mse"},
    {"pattern": "*", "format": "none"},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return rule_setup(tmp_path_factory.mktemp("algorithms"), FAMILIES, "every_algorithm", RULES, kv_cache="fp8")


def test_every_algorithm_on_every_family_exports_the_same_bytes_at_every_layout(setup):
    settings = dict(calib_size=9, seq_len=24, eval_size=3, calibrate_all_experts=True, gptq_min_tokens=1)
    assert_same_exports_at_both_layouts(setup, **settings)
    root, _, ckpts = setup
    for family in ckpts:
        with open(os.path.join(root, f"{family}-w1", "eprt.json")) as f:
            calibration = json.load(f)["quantization"]["calibration"]
        assert (calibration["algorithm"], calibration["all_experts"]) == ("gptq+mse", True), family
        # GPTQ ran on every MoE layer's routed experts: their codes are in the calibrated checkpoint
        with Checkpoint(os.path.join(root, f"{family}-w1")) as q:
            moe_layers = q.config.moe_layers
            codes = {n for n in q.names(role="calibration") if n.endswith((".gptq_w13", ".gptq_w2"))}
        assert len(codes) == 2 * len(moe_layers) > 0, (family, sorted(codes))
