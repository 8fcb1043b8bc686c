"""The rotations under every algorithm they compose with: a recipe rotating the model, then AWQ and
GPTQ on the NVFP4 routed experts and mse on FP8 attention (DeepSeek-V3's multi-token-prediction
layer quantized too), exports the same bytes calibrated in one process or at (world 2, ep 2) with
another batch size, and the export passes eprt's checks."""

import pytest

from tests.layouts.rule_runs import assert_same_exports_at_both_layouts, rule_setup

FAMILIES = ("qwen3_moe", "qwen3_next", "deepseek_v3")  # GQA with R2, gated attention and DeltaNet, MLA with MTP
RULES = [
    {"pattern": "*.experts", "format": "nvfp4", "algorithm": ["rotate", "awq", "gptq"]},
    {"pattern": "*.self_attn.*", "format": "fp8", "algorithm": "rotate+mse"},
    {"pattern": "*", "format": "none"},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    return rule_setup(tmp_path_factory.mktemp("rotation"), FAMILIES, "rotated", RULES, mtp=True)


def test_a_rotated_model_exports_the_same_bytes_at_every_layout(setup):
    assert_same_exports_at_both_layouts(setup, calib_size=6, seq_len=16, eval_size=0, gptq_min_tokens=1)
