"""tools/ptq.py as users run it: recipes, expert coverage, preview, refusals; the demo pipeline end to end."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from eprt.errors import EprtError
from eprt.families import Family
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.recipe import available
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.hf_utils import read_hf_tensors
from tests.layouts.test_ep_model import SKEWED_OUT, skew

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tool(*args, env=None, check=True):
    return subprocess.run(
        [sys.executable, *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=check,
        env={**os.environ, **(env or {})},
    )


@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen")
    return convert_hf(make_tiny("qwen3_moe", str(d / "hf")), str(d / "ck"), progress=False)


def test_experts_only_recipe_leaves_the_rest_in_the_source_dtype(qwen, tmp_path):
    run_ptq(
        ParallelState.single(),
        PTQArgs(qwen, "nvfp4_experts_only", str(tmp_path / "q"), calib_size=4, seq_len=16, progress=False),
    )
    out = export_hf(str(tmp_path / "q"), str(tmp_path / "out"), progress=False)
    t = read_hf_tensors(out)
    hq = json.load(open(os.path.join(out, "hf_quant_config.json")))["quantization"]
    assert t["model.layers.0.mlp.experts.3.gate_proj.weight"].dtype == torch.uint8
    assert t["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert "model.layers.0.self_attn.q_proj.input_scale" not in t
    # ModelOpt's prefix-wildcard summary: layer 0's attention, all of the dense layer 1
    assert {"model.layers.0.self_attn*", "model.layers.1*", "lm_head"} <= set(hq["exclude_modules"])
    assert not any("experts" in e for e in hq["exclude_modules"])


def test_unreached_experts_are_named_and_still_get_the_layer_scales(tmp_path):
    src = make_tiny("deepseek_v3", str(tmp_path / "hf"))
    tensors = load_file(str(tmp_path / "hf" / "model.safetensors"))
    skew("deepseek_v3", tensors)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"), metadata={"format": "pt"})
    ck = convert_hf(src, str(tmp_path / "ck"), progress=False)
    r = tool(
        "tools/ptq.py", ck, "--recipe", "nvfp4", "--out", str(tmp_path / "q"), "--calib-size", "4", "--seq-len", "16"
    )
    unreached = list(SKEWED_OUT)
    assert "model.layers.1.mlp.experts: tokens per expert min 0" in r.stderr
    assert f"no token reached experts {unreached}" in r.stderr
    out = export_hf(str(tmp_path / "q"), str(tmp_path / "out"), progress=False)
    assert check_export(out) == []
    t = read_hf_tensors(out)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        scales = {e: t[f"model.layers.1.mlp.experts.{e}.{proj}.input_scale"] for e in range(8)}
        reached = scales[0]
        assert float(reached) > 0 and all(torch.equal(s, reached) for s in scales.values())


def test_the_demo_pipeline_from_the_clones_tools(tmp_path):
    """The README's main job by the clone's tools: make, convert, PTQ, export, check. (Its two
    expert-parallel processes and the preview run in tests/test_install.py, by the console scripts
    these tools stand for.)"""
    tool("tools/make_tiny.py", "qwen3_moe", str(tmp_path / "hf"))
    tool("tools/convert_hf.py", str(tmp_path / "hf"), str(tmp_path / "ck"))
    tool(
        "tools/ptq.py",
        str(tmp_path / "ck"),
        "--recipe",
        "nvfp4",
        "--kv-cache",
        "fp8",
        "--calib-size",
        "8",
        "--seq-len",
        "32",
        "--out",
        str(tmp_path / "q"),
    )
    tool("tools/export_hf.py", str(tmp_path / "q"), str(tmp_path / "out"))
    assert tool("tools/check_export.py", str(tmp_path / "out")).stdout.strip().endswith("ok")
    assert json.load(open(tmp_path / "out" / "config.json"))["quantization_config"]["quant_method"] == "modelopt"


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--recipe", "int3", "--out", "OUT"],
            f"--recipe 'int3': no such recipe; choose one of {', '.join(available())} or give a YAML path",
        ),
        (["--out", "OUT"], "--recipe and --out are required"),
        (["--recipe", "fp8", "--out", "OUT", "--calib", "missing.jsonl"], "--calib missing.jsonl: no such file"),
        (["--recipe", "fp8", "--out", "OUT", "--batch-size", "0"], "--batch-size 0 must be positive"),
    ],
)
def test_refusals_name_the_setting(qwen, tmp_path, args, message):
    args = [a.replace("OUT", str(tmp_path / "q")) for a in args]
    r = tool("tools/ptq.py", qwen, *args, check=False)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert r.stderr.startswith("error: ") and "failed while" not in r.stderr  # a process alone: the refusal itself
    assert not (tmp_path / "q").exists()


def test_a_calibrated_checkpoint_is_not_calibrated_again(qwen, tmp_path):
    run_ptq(ParallelState.single(), PTQArgs(qwen, "fp8", str(tmp_path / "q"), calib_size=2, seq_len=8, progress=False))
    with pytest.raises(EprtError, match="already calibrated; run PTQ on the unquantized checkpoint"):
        run_ptq(
            ParallelState.single(),
            PTQArgs(str(tmp_path / "q"), "fp8", str(tmp_path / "q2"), calib_size=2, seq_len=8, progress=False),
        )


def test_a_run_resolves_its_checkpoint_once(qwen, tmp_path, monkeypatch):
    """The recipe, the memory plan, the engine, GPTQ, the quality report and the preview all read
    the one resolution of the checkpoint the run made at its start."""
    calls, layout = [], Family.layout
    monkeypatch.setattr(Family, "layout", lambda self, c: calls.append(self.name) or layout(self, c))
    run_ptq(
        ParallelState.single(),
        PTQArgs(
            qwen,
            "fp8",
            str(tmp_path / "q"),
            algorithm="gptq",
            preview="Hello",
            calib_size=2,
            seq_len=8,
            eval_size=2,
            progress=False,
        ),
    )
    assert calls == ["qwen3_moe"]
