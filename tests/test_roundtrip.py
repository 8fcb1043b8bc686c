"""make_tiny -> convert_hf -> export_hf reproduces every source tensor and file byte for byte."""

import filecmp
import json
import os
import subprocess
import sys

import pytest
import torch

from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import TOKENIZER_FILES, make_tiny
from tests.hf_utils import raw, read_hf_tensors, tree_digest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def assert_same_checkpoint(src: str, out: str) -> None:
    a, b = read_hf_tensors(src), read_hf_tensors(out)
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype, name
        assert a[name].shape == b[name].shape, name
        assert raw(a[name]) == raw(b[name]), name
    for f in ["config.json", *TOKENIZER_FILES]:
        if os.path.exists(os.path.join(src, f)):
            assert filecmp.cmp(os.path.join(src, f), os.path.join(out, f), shallow=False), f


@pytest.mark.parametrize(
    "family",
    [
        "qwen3_moe",
        "deepseek_v3",
        "glm4_moe",
        "deepseek_v32",
        "glm_moe_dsa",
        "kimi_vl",
        "qwen3_next",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "mistral4",
        "minimax_m2",
        "llama4",
        "nemotron_h",
        "nemotron_h_omni",
        "gpt_oss",
        "deepseek_v4",
    ],
)
@pytest.mark.parametrize("shards", [1, 3])
def test_tiny_round_trip(tmp_path, family, shards):
    src = make_tiny(family, str(tmp_path / "hf"), shards=shards)
    convert_hf(src, str(tmp_path / "ck"), progress=False)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), max_shard_bytes=200_000, progress=False)
    assert_same_checkpoint(src, str(tmp_path / "out"))
    index = json.load(open(tmp_path / "out" / "model.safetensors.index.json"))
    assert len(set(index["weight_map"].values())) > 1  # the export really sharded


def test_experts_are_stacked_with_the_expert_index_leading(tmp_path):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"))
    ck = Checkpoint(convert_hf(src, str(tmp_path / "ck"), progress=False))
    hf = read_hf_tensors(src)
    w13, w2 = ck.read("model.layers.0.mlp.experts.w13"), ck.read("model.layers.0.mlp.experts.w2")
    assert w13.shape == (8, 64, 64) and w2.shape == (8, 64, 32)
    for e in range(8):
        p = f"model.layers.0.mlp.experts.{e}."
        assert torch.equal(w13[e], torch.cat([hf[p + "gate_proj.weight"], hf[p + "up_proj.weight"]]))
        assert torch.equal(w2[e], hf[p + "down_proj.weight"])


def test_mtp_layer_is_carried_through(tmp_path):
    src = make_tiny("deepseek_v3", str(tmp_path / "hf"))
    ck = Checkpoint(convert_hf(src, str(tmp_path / "ck"), progress=False))
    passthrough = ck.names(role="passthrough")
    assert passthrough and all(n.startswith("model.layers.3.") for n in passthrough)
    assert "model.layers.3.eh_proj.weight" in passthrough
    assert not any(n.startswith("model.layers.3.") for n in ck.names())  # the causal LM does not run it


def test_dtype_conversion_keeps_the_router_bias_and_exports_source_dtypes(tmp_path):
    src = make_tiny("deepseek_v3", str(tmp_path / "hf"), dtype="fp32")
    ck = Checkpoint(convert_hf(src, str(tmp_path / "ck"), dtype="bf16", progress=False))
    assert ck.meta("model.layers.1.mlp.experts.w13").dtype == torch.bfloat16
    assert ck.meta("model.layers.1.mlp.gate.e_score_correction_bias").dtype == torch.float32
    assert ck.meta("model.layers.1.mlp.gate.weight").dtype == torch.float32
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), progress=False)
    a, b = read_hf_tensors(src), read_hf_tensors(str(tmp_path / "out"))
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    assert b[name].dtype == torch.float32
    assert torch.equal(b[name], a[name].bfloat16().float())


def test_transformers_save_pretrained_round_trip(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        moe_intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts=4,
        num_experts_per_tok=2,
        mlp_only_layers=[1],
        norm_topk_prob=True,
    )
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path / "hf")
    convert_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), progress=False)
    export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), progress=False)
    assert_same_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"))


def test_command_line_round_trip(tmp_path):
    def tool(*args):
        return subprocess.run(
            [sys.executable, os.path.join(ROOT, "tools", args[0]), *args[1:]],
            capture_output=True,
            text=True,
            check=True,
        )

    tool("make_tiny.py", "qwen3_moe", str(tmp_path / "hf"))
    tool("convert_hf.py", str(tmp_path / "hf"), str(tmp_path / "ck"))
    tool("export_hf.py", str(tmp_path / "ck"), str(tmp_path / "out"))
    assert_same_checkpoint(str(tmp_path / "hf"), str(tmp_path / "out"))


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """An unquantized tiny checkpoint (nothing stored encoded) and a calibration of it."""
    d = tmp_path_factory.mktemp("options")
    ck = convert_hf(make_tiny("qwen3_moe", str(d / "hf")), str(d / "ck"), progress=False)
    q = str(d / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, "fp8", q, calib_size=2, seq_len=16, eval_size=0, progress=False))
    return {"unquantized": ck, "calibrated": q}


@pytest.mark.parametrize(
    "which, options",
    [
        ("unquantized", ["--format", "compressed-tensors"]),  # its export is the source layout, never quantized
        ("unquantized", ["--format", "modelopt"]),
        ("unquantized", ["--dequantize"]),  # nothing stored encoded, no quantization_config: nothing to decode
        ("calibrated", ["--dequantize"]),  # a quantized export always starts from the decoded weights
    ],
)
def test_an_export_option_that_cannot_apply_is_refused(checkpoints, tmp_path, which, options):
    before = tree_digest(checkpoints[which])
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "tools", "export_hf.py"),
            checkpoints[which],
            str(tmp_path / "out"),
            *options,
            "--no-progress",
        ],
        capture_output=True,
        text=True,
    )
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"error: {options[0]}") and checkpoints[which] in lines[0], r.stderr
    assert not (tmp_path / "out").exists() and tree_digest(checkpoints[which]) == before
