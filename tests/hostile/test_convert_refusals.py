"""Each refusal of convert_hf names the culprit, leaves no output behind and leaves the input as it was."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from eprt.errors import EprtError
from eprt.hf.convert import convert_hf
from eprt.testing.tiny import make_tiny
from tests.hf_utils import tree_digest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SHARD = "model-00002-of-00002.safetensors"


def edit_shard(src, fn):
    path = os.path.join(src, SHARD)
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def edit_config(src, **fields):
    path = os.path.join(src, "config.json")
    cfg = {**json.load(open(path)), **fields}
    json.dump(cfg, open(path, "w"))


def drop_config(src):
    os.remove(os.path.join(src, "config.json"))


def truncate(src):
    path = os.path.join(src, SHARD)
    os.truncate(path, os.path.getsize(path) - 100)


def corrupt_header(src):
    with open(os.path.join(src, SHARD), "r+b") as f:
        f.seek(8)
        f.write(b"#garbage#")


def missing_tensor(src):
    edit_shard(src, lambda t: t.pop("model.norm.weight"))
    path = os.path.join(src, "model.safetensors.index.json")
    index = json.load(open(path))
    del index["weight_map"]["model.norm.weight"]
    json.dump(index, open(path, "w"))


def deep_index(src):
    with open(os.path.join(src, "model.safetensors.index.json"), "wb") as f:
        f.write(b'{"weight_map": ' + b"[" * 100_000 + b"]" * 100_000 + b"}")


def index_not_utf8(src):
    with open(os.path.join(src, "model.safetensors.index.json"), "wb") as f:
        f.write(b'{"weight_map": {"caf\xe9": "x"}}')


def index_disagrees(src):
    edit_shard(src, lambda t: t.pop("model.norm.weight"))


def extra_tensor(src):
    edit_shard(src, lambda t: t.__setitem__("model.layers.9.mlp.gate.weight", torch.zeros(8, 64)))


def wrong_shape(src):
    edit_shard(src, lambda t: t.__setitem__("model.norm.weight", torch.zeros(48)))


CASES = [
    (drop_config, r"config\.json: missing"),
    (
        lambda s: edit_config(s, model_type="llama"),
        r"model_type 'llama' is not supported.*deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa, kimi_k2, kimi_k25, kimi_k3, "
        r"kimi_linear, kimi_vl, minimax_m2, mistral3, mistral4, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe, qwen3_next",
    ),
    (lambda s: edit_config(s, rope_scaling={"type": "dynamic", "factor": 2.0}), r"rope scaling type 'dynamic'"),
    (truncate, rf"{SHARD}: .*truncated"),
    (corrupt_header, rf"{SHARD}: .*corrupt header"),
    (missing_tensor, r"tensor 'model\.norm\.weight' is missing"),
    (deep_index, r"model\.safetensors\.index\.json: nested too deeply to be read"),
    (index_not_utf8, r"model\.safetensors\.index\.json: not UTF-8 text \(byte \d+\)"),
    (index_disagrees, rf"{SHARD}: the index lists tensor 'model\.norm\.weight' but the file lacks it"),
    (extra_tensor, rf"{SHARD}: tensor 'model\.layers\.9\.mlp\.gate\.weight': nothing in the model reads it"),
    (wrong_shape, rf"{SHARD}: tensor 'model\.norm\.weight' has shape \[48\] but config\.json implies \[64\]"),
]


@pytest.mark.parametrize(
    "breaker,message", CASES, ids=[c[0].__name__ if c[0].__name__ != "<lambda>" else c[1][:20] for c in CASES]
)
def test_refusal(tmp_path, breaker, message):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"), shards=2)
    breaker(src)
    before = tree_digest(src)
    out = tmp_path / "out"
    with pytest.raises(EprtError, match=message):
        convert_hf(src, str(out), progress=False)
    assert not out.exists()
    assert sorted(os.listdir(tmp_path)) == ["hf"]  # no temp directory either
    assert tree_digest(src) == before


def test_existing_output_is_refused_unless_overwrite(tmp_path):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("precious")
    with pytest.raises(EprtError, match=rf"{out} exists and is not empty; pass --overwrite"):
        convert_hf(src, str(out), progress=False)
    assert (out / "keep.txt").read_text() == "precious"
    convert_hf(src, str(out), overwrite=True, progress=False)
    assert (out / "eprt.json").exists() and not (out / "keep.txt").exists()


def test_output_inside_the_input_is_refused(tmp_path):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"))
    before = tree_digest(src)
    with pytest.raises(EprtError, match="overlaps the input"):
        convert_hf(src, src, overwrite=True, progress=False)
    assert tree_digest(src) == before


def test_command_line_refusal_is_one_clear_line(tmp_path):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"))
    truncate_single = os.path.join(src, "model.safetensors")
    os.truncate(truncate_single, os.path.getsize(truncate_single) - 10)
    r = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tools", "convert_hf.py"), src, str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert r.stderr.startswith("error: ") and "model.safetensors" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "out").exists()


def test_a_cast_that_overflows_is_refused_by_name(tmp_path):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"), dtype="fp32")
    path = os.path.join(src, "model.safetensors")
    tensors = load_file(path)
    name = "model.layers.0.mlp.experts.2.up_proj.weight"
    tensors[name][3, 5] = -3.4e38  # finite in fp32, beyond bf16's largest (3.39e38): the cast makes it -inf
    save_file(tensors, path, metadata={"format": "pt"})
    before = tree_digest(src)
    with pytest.raises(
        EprtError,
        match=rf"model\.safetensors: tensor '{name}' holds values up to 3\.4e\+38 in "
        r"magnitude, beyond bf16's largest .* convert with --dtype keep or --dtype fp32",
    ):
        convert_hf(src, str(tmp_path / "out"), dtype="bf16", progress=False)
    assert sorted(os.listdir(tmp_path)) == ["hf"] and tree_digest(src) == before
    convert_hf(src, str(tmp_path / "out"), dtype="fp32", progress=False)  # the way out
