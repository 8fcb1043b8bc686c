"""What eprt-check passes, an engine loads: real exports of the tiny Qwen3-MoE (ModelOpt NVFP4,
ModelOpt MIXED_PRECISION with NVFP4 experts and FP8 attention, and the compressed-tensors layout
of the same), each broken in one way an engine would trip on, must be named.

- every shard the index names lies inside the export (links followed);
- every tensor has the shape config.json gives its module (per format: FP8 [out, in], NVFP4
  packed [out, in/2] with [out, in/16] block scales), with and without --source;
- every scale is one the engines' fp32 arithmetic survives: its reciprocal, and the products
  they form (weight_scale_2 * input_scale, 448 * scale), finite and not flushed to zero."""

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny

INDEX = "model.safetensors.index.json"
L0 = "model.layers.0"
EXPERTS = 8


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The source, its eprt checkpoint, and kind -> export: modelopt NVFP4, modelopt mixed, compressed-tensors mixed."""
    d = tmp_path_factory.mktemp("safety")
    hf = make_tiny("qwen3_moe", str(d / "hf"))
    ck = convert_hf(hf, str(d / "ck"), progress=False)
    exports = {}
    for recipe in ("nvfp4", "nvfp4_experts_fp8_attention"):
        q = str(d / recipe)
        run_ptq(
            ParallelState.single(),
            PTQArgs(ck, recipe, q, kv_cache="fp8", calib_size=2, seq_len=16, eval_size=0, progress=False),
        )
        exports["nvfp4" if recipe == "nvfp4" else "mixed"] = export_hf(q, q + "-modelopt", progress=False)
        if recipe != "nvfp4":
            exports["ct"] = export_hf(q, q + "-ct", progress=False, fmt="compressed-tensors")
    return hf, ck, exports


def copy_of(built, kind, tmp_path) -> Path:
    return Path(shutil.copytree(built[2][kind], tmp_path / kind))


def shard_of(out: Path, name: str) -> Path:
    return out / json.loads((out / INDEX).read_text())["weight_map"][name]


def read(out: Path, name: str) -> torch.Tensor:
    with safe_open(shard_of(out, name), "pt") as f:
        return f.get_tensor(name)


def replace(out: Path, **tensors: torch.Tensor) -> None:
    """Rewrite the shards holding `tensors` (names with `__` for `.`) with these values."""
    for key, t in tensors.items():
        name = key.replace("__", ".")
        path = shard_of(out, name)
        held = load_file(path)
        held[name] = t
        save_file(held, path)


def scalar(value: float, like: torch.Tensor) -> torch.Tensor:
    return torch.full(like.shape, value, dtype=torch.float32)


# ------------------------------------------------------------------------------ containment


def test_a_valid_export_passes_with_and_without_its_source(built):
    hf, _, exports = built
    for out in exports.values():
        assert check_export(out) == [] and check_export(out, hf) == []


def test_an_index_naming_a_shard_outside_the_export_is_refused(built, tmp_path):
    out = copy_of(built, "mixed", tmp_path)
    index = json.loads((out / INDEX).read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    shutil.move(out / first, tmp_path / "elsewhere.safetensors")  # the bytes are all there, outside
    index["weight_map"] = {n: "../elsewhere.safetensors" if s == first else s for n, s in index["weight_map"].items()}
    (out / INDEX).write_text(json.dumps(index))
    problems = check_export(out)
    assert problems and all("../elsewhere.safetensors" in p for p in problems), problems
    assert any("leaves its directory" in p for p in problems), problems


def test_a_shard_linking_outside_the_export_is_refused(built, tmp_path):
    out = copy_of(built, "nvfp4", tmp_path)
    first = sorted(set(json.loads((out / INDEX).read_text())["weight_map"].values()))[0]
    shutil.move(out / first, tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", out / first)
    problems = check_export(out)
    assert len(problems) == 1 and problems[0].startswith(f"{INDEX}: {first} links to"), problems


@pytest.mark.parametrize("shard", [["a.safetensors"], 7, None])
def test_an_index_naming_a_shard_by_something_not_a_path_is_refused(built, tmp_path, shard):
    out = copy_of(built, "nvfp4", tmp_path)
    index = json.loads((out / INDEX).read_text())
    index["weight_map"]["model.norm.weight"] = shard
    (out / INDEX).write_text(json.dumps(index))
    problems = check_export(out)
    assert problems == [f"{INDEX}: weight_map maps model.norm.weight to {shard!r}, not a shard's file name"], problems


# ------------------------------------------------------------------------------ shapes against config.json


def one_block_short(out: Path, module: str, packed: bool) -> None:
    """Drop the last 16 input columns of an NVFP4 module: its weight and its block scales, consistently."""
    weight, blocks = f"{module}.{'weight_packed' if packed else 'weight'}", f"{module}.weight_scale"
    replace(
        out,
        **{
            weight.replace(".", "__"): read(out, weight)[:, :-8].contiguous(),
            blocks.replace(".", "__"): read(out, blocks)[:, :-1].contiguous(),
        },
    )


SHORT = [
    # (export, module, how it is cut)
    ("nvfp4", f"{L0}.self_attn.o_proj", "nvfp4"),
    ("nvfp4", "model.layers.1.mlp.down_proj", "nvfp4"),  # the dense MLP
    ("mixed", f"{L0}.mlp.experts.3.down_proj", "nvfp4"),
    ("mixed", f"{L0}.mlp.experts.5.gate_proj", "nvfp4"),
    ("mixed", f"{L0}.self_attn.o_proj", "fp8"),
    ("ct", f"{L0}.mlp.experts.3.down_proj", "ct-nvfp4"),
    ("ct", f"{L0}.self_attn.k_proj", "fp8"),
]


@pytest.mark.parametrize("kind, module, cut", SHORT, ids=[f"{k}-{m.split('.', 2)[2]}" for k, m, _ in SHORT])
def test_a_weight_shorter_than_config_json_says_is_refused(built, tmp_path, kind, module, cut):
    hf = built[0]
    out = copy_of(built, kind, tmp_path)
    if cut == "fp8":  # one output row fewer: the per-tensor scales fit any shape
        replace(out, **{f"{module}.weight".replace(".", "__"): read(out, f"{module}.weight")[:-1].contiguous()})
    else:
        one_block_short(out, module, packed=cut == "ct-nvfp4")
    for source in (None, hf):
        problems = check_export(out, source)
        assert problems and all(p.startswith(module) for p in problems), problems
        assert any("config.json" in p for p in problems), problems


def test_an_unquantized_tensor_of_the_wrong_shape_is_refused(built, tmp_path):
    out = copy_of(built, "mixed", tmp_path)
    replace(out, model__norm__weight=read(out, "model.norm.weight")[:-1].contiguous())
    for source in (None, built[0]):
        problems = check_export(out, source)
        assert len(problems) == 1 and problems[0].startswith("model.norm.weight: has shape [63]"), problems


# ------------------------------------------------------------------------------ scales in the engines' fp32


def every_expert(out: Path, leaf: str, value: float, kind: str = "down_proj") -> dict[str, torch.Tensor]:
    """`leaf` of every expert's `kind` in layer 0 set to `value` (the fused MoE loads one per kind)."""
    names = [f"{L0}.mlp.experts.{e}.{kind}.{leaf}" for e in range(EXPERTS)]
    return {n.replace(".", "__"): scalar(value, read(out, n)) for n in names}


ATTN = f"{L0}.self_attn"
SCALES = [
    # (export, tensors to set: name -> value, the name every problem carries)
    ("mixed", {f"{ATTN}.o_proj.input_scale": 1e-40}, f"{ATTN}.o_proj.input_scale"),  # 1/x is inf in fp32
    ("mixed", {f"{ATTN}.o_proj.weight_scale": 1e-39}, f"{ATTN}.o_proj.weight_scale"),  # subnormal: flushed to 0
    ("mixed", {f"{ATTN}.o_proj.input_scale": 1e20, f"{ATTN}.o_proj.weight_scale": 1e20}, f"{ATTN}.o_proj"),
    ("mixed", {f"{ATTN}.o_proj.weight_scale": 1e37}, f"{ATTN}.o_proj.weight_scale"),  # 448 x it overflows
    ("nvfp4", {f"{ATTN}.o_proj.input_scale": 1e-20, f"{ATTN}.o_proj.weight_scale_2": 1e-20}, f"{ATTN}.o_proj"),
    ("nvfp4", {f"{ATTN}.o_proj.weight_scale_2": 1e36}, f"{ATTN}.o_proj.weight_scale_2"),  # 6 x 448 x it overflows
    ("nvfp4", {f"{ATTN}.k_proj.k_scale": 1e-40}, f"{ATTN}.k_proj.k_scale"),
    ("mixed", {f"{ATTN}.v_proj.v_scale": 3e38}, f"{ATTN}.v_proj.v_scale"),
    ("ct", {f"{ATTN}.o_proj.input_scale": 1e-40}, f"{ATTN}.o_proj.input_scale"),
    ("ct", {f"{ATTN}.k_scale": 1e-40}, f"{ATTN}.k_scale"),
]


@pytest.mark.parametrize(
    "kind, values, target", SCALES, ids=[f"{k}-{t.rsplit('.', 2)[-2]}-{i}" for i, (k, _, t) in enumerate(SCALES)]
)
def test_a_scale_the_engines_arithmetic_cannot_take_is_refused(built, tmp_path, kind, values, target):
    out = copy_of(built, kind, tmp_path)
    replace(out, **{n.replace(".", "__"): scalar(v, read(out, n)) for n, v in values.items()})
    problems = check_export(out)
    assert problems and all(p.startswith(target) for p in problems), problems


@pytest.mark.parametrize(
    "kind, leaf, value",
    [
        ("mixed", "input_scale", 1e-40),
        ("nvfp4", "input_scale", 1e-40),
        ("ct", "input_global_scale", 1e-40),
        ("ct", "weight_global_scale", 2e38),
        ("mixed", "weight_scale_2", 1e-39),
    ],
)
def test_expert_scales_out_of_the_engines_range_are_refused(built, tmp_path, kind, leaf, value):
    out = copy_of(built, kind, tmp_path)
    replace(out, **every_expert(out, leaf, value))
    problems = check_export(out)
    assert len(problems) == EXPERTS, problems
    assert all(p.startswith(f"{L0}.mlp.experts.") and f"down_proj.{leaf}" in p for p in problems), problems


# ------------------------------------------------------------------------------ W4A4 experts' input scales


def drop(out: Path, *names: str) -> None:
    """Remove tensors `names` from their shards and the index."""
    index = json.loads((out / INDEX).read_text())
    for name in names:
        path = shard_of(out, name)
        held = load_file(path)
        del held[name]
        save_file(held, path)
        del index["weight_map"][name]
    (out / INDEX).write_text(json.dumps(index))


def edit_quantization_config(out: Path, edit) -> None:
    config = json.loads((out / "config.json").read_text())
    edit(config["quantization_config"])
    (out / "config.json").write_text(json.dumps(config))


EXPERT = f"{L0}.mlp.experts.3.up_proj"
NVFP4_LEAVES = ("weight_packed", "weight_scale", "weight_global_scale", "input_global_scale")


def ignored_expert(out: Path) -> None:
    """Expert 3's up_proj left unquantized (bf16, no scale) and ignored by the config."""
    packed = f"{EXPERT}.weight_packed"
    rows, half = read(out, packed).shape
    drop(out, *(f"{EXPERT}.{leaf}" for leaf in NVFP4_LEAVES if leaf != "weight_packed"))
    index = json.loads((out / INDEX).read_text())
    path = shard_of(out, packed)
    held = load_file(path)
    del held[packed]
    held[f"{EXPERT}.weight"] = torch.zeros(rows, 2 * half, dtype=torch.bfloat16)
    save_file(held, path)
    index["weight_map"][f"{EXPERT}.weight"] = index["weight_map"].pop(packed)
    (out / INDEX).write_text(json.dumps(index))
    edit_quantization_config(out, lambda qc: qc["ignore"].append(EXPERT))


def weight_only_expert(out: Path) -> None:
    """Expert 3's up_proj in a group of its own with NVFP4 weights and bf16 inputs (W4A16), which
    a fused MoE cannot give one expert: it stores no input scale."""
    drop(out, f"{EXPERT}.input_global_scale")

    def edit(qc):
        nvfp4 = next(g for g in qc["config_groups"].values() if g["format"] == "nvfp4-pack-quantized")
        qc["config_groups"] = {
            "w4a16": {**nvfp4, "targets": [EXPERT], "input_activations": None},
            **qc["config_groups"],
        }

    edit_quantization_config(out, edit)


@pytest.mark.parametrize("break_it", [ignored_expert, weight_only_expert])
def test_a_w4a4_experts_layer_with_an_expert_lacking_its_input_scale_is_refused(built, tmp_path, break_it):
    """vLLM loads a layer's routed experts as one fused NVFP4 MoE: an expert projection the export
    gives no input scale (left unquantized, or weight-only) loads as 0, an inf global scale."""
    out = copy_of(built, "ct", tmp_path)
    break_it(out)
    for source in (None, built[0]):
        problems = check_export(out, source)
        assert len(problems) == 1 and problems[0].startswith(f"{L0}.mlp.experts: NVFP4 W4A4 routed experts"), problems
        assert f"no input_global_scale ({EXPERT})" in problems[0]


def test_a_modelopt_expert_without_its_input_scale_is_refused(built, tmp_path):
    out = copy_of(built, "nvfp4", tmp_path)
    drop(out, f"{EXPERT}.input_scale")
    assert check_export(out) == [f"{EXPERT}.input_scale: missing (quantized module {EXPERT})"]
