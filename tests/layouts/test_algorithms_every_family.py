"""mse, gptq and --calibrate-all-experts on every family: one recipe runs two algorithms by rule
(GPTQ'd NVFP4 routed experts, mse-scaled FP8 attention), with every expert calibrated on every
token, the quality report and the FP8 KV cache, and its export is the same bytes calibrated in
one process or at (world 2, ep 2) with another batch size."""

import json
import os
from datetime import timedelta

import pytest
import yaml

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.layouts.test_ptq import FAMILIES, GROUP_TOKENS, same_files
from tests.multiproc import free_port, run_world

RULES = [
    {"pattern": "*.experts", "format": "nvfp4", "algorithm": "gptq"},
    {"pattern": "*.self_attn.*", "format": "fp8", "algorithm": "mse"},
    {"pattern": "*", "format": "none"},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("algorithms")
    recipe = str(root / "every_algorithm.yaml")
    with open(recipe, "w") as f:
        yaml.safe_dump({"name": "every_algorithm", "quantize": RULES, "kv_cache": "fp8"}, f)
    ckpts = {
        fam: convert_hf(make_tiny(fam, str(root / f"hf-{fam}")), str(root / f"ck-{fam}"), progress=False)
        for fam in FAMILIES
    }
    return str(root), recipe, ckpts


def calibrate(root: str, recipe: str, ckpts: dict, ep: int, port: int | None) -> None:
    if port is not None:
        os.environ["MASTER_PORT"] = str(port)
    state = ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) if port is not None else ParallelState.single()
    with state:
        for family, ck in ckpts.items():
            out = os.path.join(root, f"{family}-w{state.world}")
            run_ptq(
                state,
                PTQArgs(
                    ck,
                    recipe,
                    out,
                    calib_size=9,
                    seq_len=24,
                    batch_size=1 if ep == 1 else 3,
                    group_tokens=GROUP_TOKENS,
                    eval_size=3,
                    calibrate_all_experts=True,
                    gptq_min_tokens=1,
                    progress=False,
                ),
            )


def test_every_algorithm_on_every_family_exports_the_same_bytes_at_every_layout(setup):
    root, recipe, ckpts = setup
    calibrate(root, recipe, ckpts, 1, None)
    run_world(calibrate, 2, root, recipe, ckpts, 2, free_port(), timeout=600)
    for family in ckpts:
        exports = [
            export_hf(os.path.join(root, f"{family}-w{w}"), os.path.join(root, f"export-{family}-w{w}"), progress=False)
            for w in (1, 2)
        ]
        assert check_export(exports[0]) == [], family
        assert same_files(*exports), family
        with open(os.path.join(root, f"{family}-w1", "eprt.json")) as f:
            calibration = json.load(f)["quantization"]["calibration"]
        assert (calibration["algorithm"], calibration["all_experts"]) == ("gptq+mse", True), family
        # GPTQ ran on every MoE layer's routed experts: their codes are in the calibrated checkpoint
        with Checkpoint(os.path.join(root, f"{family}-w1")) as q:
            moe_layers = q.config.moe_layers
            codes = {n for n in q.names(role="calibration") if n.endswith((".gptq_w13", ".gptq_w2"))}
        assert len(codes) == 2 * len(moe_layers) > 0, (family, sorted(codes))
