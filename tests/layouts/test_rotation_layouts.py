"""The rotations under every algorithm they compose with: a recipe rotating the model, then AWQ and
GPTQ on the NVFP4 routed experts and mse on FP8 attention (DeepSeek-V3's multi-token-prediction
layer quantized too), exports the same bytes calibrated in one process or at (world 2, ep 2) with
another batch size, and the export passes eprt's checks."""

import os
from datetime import timedelta

import pytest
import yaml

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.layouts.test_ptq import GROUP_TOKENS, same_files
from tests.multiproc import free_port, run_world

FAMILIES = ("qwen3_moe", "qwen3_next", "deepseek_v3")  # GQA with R2, gated attention and DeltaNet, MLA with MTP
RULES = [
    {"pattern": "*.experts", "format": "nvfp4", "algorithm": ["rotate", "awq", "gptq"]},
    {"pattern": "*.self_attn.*", "format": "fp8", "algorithm": "rotate+mse"},
    {"pattern": "*", "format": "none"},
]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("rotation")
    recipe = str(root / "rotated.yaml")
    with open(recipe, "w") as f:
        yaml.safe_dump({"name": "rotated", "quantize": RULES, "mtp": True}, f)
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
            args = PTQArgs(
                ck,
                recipe,
                os.path.join(root, f"{family}-w{state.world}"),
                calib_size=6,
                seq_len=16,
                batch_size=1 if ep == 1 else 3,
                group_tokens=GROUP_TOKENS,
                eval_size=0,
                gptq_min_tokens=1,
                progress=False,
            )
            run_ptq(state, args)


def test_a_rotated_model_exports_the_same_bytes_at_every_layout(setup):
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
