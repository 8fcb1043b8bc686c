"""tools/check_export.py and eprt.hf.check_export on small exports built by hand here.

The toy is a 2-layer Qwen3-MoE-shaped model: attention q/k/v/o in both layers, a dense MLP in
layer 0, 4 routed experts and a router in layer 1, lm_head and the router excluded.
"""

import copy
import json
import os
import runpy
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import eprt.hf.check_exclusions as check_exclusions_module
from eprt.hf.check_engine_quirks import absorbed_factor, engine_warnings
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.absorbed import quantizes_inputs_to_4_bits
from eprt.quant.formats import weight_format
from eprt.quant.formats.fp8 import fp8_scale, quantize_fp8
from eprt.quant.formats.nvfp4 import nvfp4_scale, quantize_nvfp4
from eprt.quant.recipe import load_recipe
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny

H, VOCAB, EXPERTS = 32, 64, 4
TOOL = Path(__file__).resolve().parents[1] / "tools" / "check_export.py"
RECIPES = Path(__file__).resolve().parents[1] / "eprt" / "configs" / "ptq"
EXCLUDE = ["lm_head", "model.embed_tokens", "model.layers.1.mlp.gate"]


def _add_linears(t, algo, weights, in_amax, share_weight_amax):
    """Quantize `weights` {module: fp32 [out, in]} into t; NVFP4 groups share one weight amax."""
    group_amax = max(w.abs().max().item() for w in weights.values())
    for module, w in weights.items():
        amax = group_amax if share_weight_amax else w.abs().max().item()
        if algo == "FP8":
            scale = fp8_scale(amax)
            t[f"{module}.weight"] = quantize_fp8(w, scale)
            t[f"{module}.weight_scale"] = scale
            t[f"{module}.input_scale"] = fp8_scale(in_amax)
        else:
            scale_2 = nvfp4_scale(amax)
            t[f"{module}.weight"], t[f"{module}.weight_scale"] = quantize_nvfp4(w, scale_2)
            t[f"{module}.weight_scale_2"] = scale_2
            t[f"{module}.input_scale"] = nvfp4_scale(in_amax)


def make_toy(algo, kv=True):
    """(tensors, config, hf_quant_config) of a valid export."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(shape, generator=g) * 0.05

    nvfp4 = algo == "NVFP4"
    t = {
        "model.embed_tokens.weight": rand(VOCAB, H).bfloat16(),
        "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
        "lm_head.weight": rand(VOCAB, H).bfloat16(),
    }
    for layer in range(2):
        p = f"model.layers.{layer}"
        norms = {"input_layernorm": H, "post_attention_layernorm": H, "self_attn.q_norm": 8, "self_attn.k_norm": 8}
        for norm, size in norms.items():
            t[f"{p}.{norm}.weight"] = torch.ones(size, dtype=torch.bfloat16)
        qkv = {f"{p}.self_attn.{n}_proj": rand(out, H) for n, out in (("q", 32), ("k", 16), ("v", 16))}
        _add_linears(t, algo, qkv, in_amax=2.0 + layer, share_weight_amax=nvfp4)
        _add_linears(t, algo, {f"{p}.self_attn.o_proj": rand(H, 32)}, in_amax=1.5, share_weight_amax=False)
        if kv:
            t[f"{p}.self_attn.k_proj.k_scale"] = fp8_scale(3.0 + layer)
            t[f"{p}.self_attn.v_proj.v_scale"] = fp8_scale(0.5 + layer)
        if layer == 0:
            gate_up = {f"{p}.mlp.{n}_proj": rand(64, H) for n in ("gate", "up")}
            _add_linears(t, algo, gate_up, in_amax=4.0, share_weight_amax=nvfp4)
            _add_linears(t, algo, {f"{p}.mlp.down_proj": rand(H, 64)}, in_amax=0.75, share_weight_amax=False)
            continue
        t[f"{p}.mlp.gate.weight"] = rand(EXPERTS, H).bfloat16()
        for e in range(EXPERTS):
            x = f"{p}.mlp.experts.{e}"
            # every expert gets the layer's input amax per kind; gate and up share a weight amax
            gate_up = {f"{x}.{n}_proj": rand(16, H) for n in ("gate", "up")}
            _add_linears(t, algo, gate_up, in_amax=5.0, share_weight_amax=True)
            _add_linears(t, algo, {f"{x}.down_proj": rand(H, 16)}, in_amax=0.25, share_weight_amax=False)

    group = {"dynamic": False, "num_bits": 4 if nvfp4 else 8, "type": "float"}
    quantization = {"quant_algo": algo, "kv_cache_quant_algo": "FP8" if kv else None, "exclude_modules": list(EXCLUDE)}
    if nvfp4:
        group["group_size"] = quantization["group_size"] = 16
    producer = {"name": "modelopt", "version": "0.47.0"}
    qc = {
        "quant_method": "modelopt",
        "quant_algo": algo,
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": dict(group), "input_activations": dict(group)}},
        "ignore": list(EXCLUDE),
        "producer": producer,
    }
    if kv:
        qc["kv_cache_scheme"] = {"dynamic": False, "num_bits": 8, "type": "float"}
    config = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "quantization_config": qc}
    return t, config, {"producer": producer, "quantization": quantization}


def write(out: Path, tensors, config, hf_quant, shards=2):
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    (out / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(out / "model.safetensors"))
        return out
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        save_file({n: tensors[n] for n in part}, str(out / file))
        weight_map.update({n: file for n in part})
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return out


TOYS = {}


def toy(algo, kv=True):
    """A fresh copy of the toy (built once per kind) that a test may change."""
    if (algo, kv) not in TOYS:
        TOYS[algo, kv] = make_toy(algo, kv)
    t, config, hf_quant = TOYS[algo, kv]
    return dict(t), copy.deepcopy(config), copy.deepcopy(hf_quant)


def exclude_also(config, hf_quant, *names):
    config["quantization_config"]["ignore"] += names
    hf_quant["quantization"]["exclude_modules"] += names


def unquantize(t, module, rand_shape):
    for leaf in ("weight_scale", "weight_scale_2", "input_scale"):
        t.pop(f"{module}.{leaf}", None)
    t[f"{module}.weight"] = torch.zeros(rand_shape, dtype=torch.bfloat16)


# ------------------------------------------------------------------------------ valid


@pytest.mark.parametrize(("algo", "kv", "shards"), [("FP8", False, 2), ("FP8", True, 1), ("NVFP4", True, 2)])
def test_valid_exports_pass(tmp_path, algo, kv, shards):
    out = write(tmp_path / "out", *toy(algo, kv), shards=shards)
    assert check_export(out) == []


def test_excluded_qkv_listed_exactly_passes(tmp_path):
    t, config, hf_quant = toy("NVFP4")
    for n, out in (("q", 32), ("k", 16), ("v", 16)):
        unquantize(t, f"model.layers.0.self_attn.{n}_proj", (out, H))
    exclude_also(config, hf_quant, *(f"model.layers.0.self_attn.{n}_proj" for n in "qkv"))
    assert check_export(write(tmp_path / "out", t, config, hf_quant)) == []


# ------------------------------------------------------------------------------ broken, one violation each


# Each mutation breaks the toy in one place, named by `target`: fn(tensors, config, hf_quant, target).


def drop(t, config, hf_quant, name):
    del t[name]


def set_to(value):
    def mutate(t, config, hf_quant, name):
        t[name] = value if isinstance(value, torch.Tensor) else torch.tensor(value, dtype=torch.float32)

    return mutate


def times(factor):
    def mutate(t, config, hf_quant, name):
        t[name] = t[name] * factor

    return mutate


def exclude(entry=None):
    def mutate(t, config, hf_quant, name):
        exclude_also(config, hf_quant, entry or name)

    return mutate


def unlist(t, config, hf_quant, name):
    config["quantization_config"]["ignore"].remove(name)
    hf_quant["quantization"]["exclude_modules"].remove(name)


def config_key(path, value):
    """Set (value) or delete (None) `config:KEY` of config.json's quantization_config or
    `hf:KEY` of hf_quant_config.json's quantization."""

    def mutate(t, config, hf_quant, name):
        file, key = path.split(":")
        d = config["quantization_config"] if file == "config" else hf_quant["quantization"]
        if value is None:
            del d[key]
        else:
            d[key] = value

    return mutate


def unquantize_q(t, config, hf_quant, name):
    unquantize(t, f"{L0}.self_attn.q_proj", (32, H))
    exclude_also(config, hf_quant, f"{L0}.self_attn.q_proj")


def qkv_by_pattern(t, config, hf_quant, name):
    for n, out in (("q", 32), ("k", 16), ("v", 16)):
        unquantize(t, f"{L0}.self_attn.{n}_proj", (out, H))
    exclude_also(config, hf_quant, *(f"{L0}.self_attn.{n}_proj*" for n in "qkv"))


L0, L1 = "model.layers.0", "model.layers.1"
EXP = f"{L1}.mlp.experts"
O_PROJ = f"{L0}.self_attn.o_proj"
FP8_BLOCK = torch.float8_e4m3fn
FOUR_BIT_WEIGHTS = {
    "group_0": {"weights": {"num_bits": 4, "type": "float"}, "input_activations": {"num_bits": 8, "type": "float"}}
}
BROKEN = [
    # (id, algo, the name every violation must carry, mutation)
    ("missing-input-scale", "FP8", f"{O_PROJ}.input_scale", drop),
    ("missing-weight-scale-2", "NVFP4", f"{EXP}.1.down_proj.weight_scale_2", drop),
    ("missing-block-scales", "NVFP4", f"{L0}.mlp.down_proj.weight_scale", drop),
    ("zero-weight-scale", "FP8", f"{EXP}.2.down_proj.weight_scale", set_to(0.0)),
    ("zero-weight-scale-2", "NVFP4", f"{EXP}.2.down_proj.weight_scale_2", set_to(0.0)),
    ("nan-input-scale", "FP8", f"{L0}.mlp.down_proj.input_scale", set_to(float("nan"))),
    ("nan-input-scale-nvfp4", "NVFP4", f"{O_PROJ}.input_scale", set_to(float("nan"))),
    ("scale-shape-1", "FP8", f"{O_PROJ}.weight_scale", set_to(torch.tensor([0.01]))),
    ("scale-bf16", "NVFP4", f"{O_PROJ}.weight_scale_2", set_to(torch.tensor(0.01, dtype=torch.bfloat16))),
    ("block-scale-shape", "NVFP4", f"{O_PROJ}.weight_scale", set_to(torch.ones(32, 1, dtype=FP8_BLOCK))),
    ("block-scale-zero", "NVFP4", f"{O_PROJ}.weight_scale", set_to(torch.zeros(32, 2, dtype=FP8_BLOCK))),
    ("expert-gate-up-scale-2", "NVFP4", f"{EXP}.3.up_proj.weight_scale_2", times(2.0)),
    ("dense-gate-up-scale-2", "NVFP4", f"{L0}.mlp.up_proj.weight_scale_2", times(2.0)),
    ("qkv-input-scale", "NVFP4", f"{L1}.self_attn.v_proj.input_scale", times(2.0)),
    ("expert-input-scale", "FP8", f"{EXP}.2.gate_proj.input_scale", times(1.5)),
    ("expert-input-scale-nvfp4", "NVFP4", f"{EXP}.0.down_proj.input_scale", times(1.5)),
    ("excluded-has-scale", "NVFP4", "lm_head.input_scale", set_to(0.01)),
    ("excluded-substring", "FP8", f"{EXP}.1", exclude()),
    ("excluded-quantized", "NVFP4", O_PROJ, exclude()),
    ("expert-of-layer-excluded", "NVFP4", EXP, exclude(f"{EXP}.9.gate_proj")),
    ("fused-name-excluded", "FP8", f"{L0}.self_attn.qkv_proj", exclude()),
    ("fused-name-substring", "NVFP4", "self_attn.qkv_proj", exclude("self_attn.qkv")),
    ("unlisted-router", "FP8", f"{L1}.mlp.gate", unlist),
    ("qkv-mixed", "NVFP4", f"{L0}.self_attn.qkv_proj", unquantize_q),
    ("qkv-by-pattern", "NVFP4", f"{L0}.self_attn.qkv_proj", qkv_by_pattern),
    ("ignore-differs", "NVFP4", "lm_head", config_key("config:ignore", ["model.embed_tokens", f"{L1}.mlp.gate"])),
    ("algo-differs", "NVFP4", "quant_algo", config_key("config:quant_algo", "FP8")),
    ("kv-scheme-missing", "NVFP4", "kv_cache", config_key("config:kv_cache_scheme", None)),
    ("config-groups-bits", "FP8", "group_0.weights", config_key("config:config_groups", FOUR_BIT_WEIGHTS)),
    ("nvfp4-group-size-missing", "NVFP4", "group_size", config_key("hf:group_size", None)),
    ("missing-v-scale", "NVFP4", f"{L1}.self_attn.v_proj.v_scale", drop),
    ("zero-k-scale", "FP8", f"{L0}.self_attn.k_proj.k_scale", set_to(0.0)),
]


@pytest.mark.parametrize(("algo", "target", "mutate"), [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_broken_export_names_the_fault(tmp_path, algo, target, mutate):
    t, config, hf_quant = toy(algo)
    mutate(t, config, hf_quant, target)
    problems = check_export(write(tmp_path / "out", t, config, hf_quant))
    assert problems, "the checker passed a broken export"
    assert all(target in p for p in problems), problems


def test_nvfp4_exclude_modules_missing(tmp_path):
    t, config, hf_quant = toy("NVFP4")
    del hf_quant["quantization"]["exclude_modules"]
    problems = check_export(write(tmp_path / "out", t, config, hf_quant))
    assert problems[0] == "hf_quant_config.json quantization.exclude_modules: missing; vLLM requires it for NVFP4"
    # vLLM then reads no exclusions: the config lists disagree and lm_head and the router go unlisted.
    assert "only in ignore" in problems[1]
    assert [p.split(":")[0] for p in problems[2:]] == ["lm_head", f"{L1}.mlp.gate"]


def test_kv_scale_without_kv_quantization(tmp_path):
    t, config, hf_quant = toy("FP8", kv=False)
    t[f"{L1}.self_attn.k_proj.k_scale"] = fp8_scale(1.0)
    assert check_export(write(tmp_path / "out", t, config, hf_quant)) == [
        f"{L1}.self_attn.k_proj.k_scale: KV-cache scale in an export without kv_cache_quant_algo"
    ]


@pytest.mark.parametrize(
    "name, value",
    [
        (f"{L1}.self_attn.k_amax", torch.tensor(3.0)),
        (f"{L0}.self_attn.o_proj.input_amax", torch.tensor(1.5)),
        (f"{L1}.mlp.experts.tokens", torch.ones(EXPERTS, dtype=torch.int64)),
    ],
)
def test_calibration_state_is_refused_by_name(tmp_path, name, value):
    # the toy's config is not one eprt can lay out, so the rule for every model applies
    t, config, hf_quant = toy("NVFP4")
    t[name] = value
    problems = check_export(write(tmp_path / "out", t, config, hf_quant))
    assert len(problems) == 1 and problems[0].startswith(f"{name}: "), problems


def test_index_must_name_exactly_the_stored_tensors(tmp_path):
    out = write(tmp_path / "out", *toy("FP8"))
    index_path = out / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    dropped = f"{L0}.mlp.up_proj.weight_scale"
    shard = index["weight_map"].pop(dropped)
    index["weight_map"][f"{L0}.mlp.extra.weight"] = shard
    index_path.write_text(json.dumps(index))
    problems = check_export(out)
    assert len(problems) == 2, problems
    assert dropped in problems[0] and "not in model.safetensors.index.json" in problems[0]
    assert f"{L0}.mlp.extra.weight" in problems[1]


def test_tool_exit_code_and_message(tmp_path):
    t, config, hf_quant = toy("NVFP4")
    del t[f"{L0}.self_attn.o_proj.input_scale"]
    bad = write(tmp_path / "bad", t, config, hf_quant)
    r = subprocess.run([sys.executable, str(TOOL), str(bad)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout + r.stderr
    assert r.stdout.splitlines() == [
        f"{L0}.self_attn.o_proj.input_scale: missing (quantized module {L0}.self_attn.o_proj)",
        f"{bad}: 1 violation(s) of the quantized export layout",
    ]


def test_tool_passes_a_valid_export(tmp_path, monkeypatch, capsys):
    good = write(tmp_path / "good", *toy("FP8"))
    monkeypatch.setattr(sys, "argv", ["check_export.py", str(good)])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(TOOL), run_name="__main__")
    assert exit_.value.code == 0
    assert capsys.readouterr().out == f"{good}: ok\n"


def fnmatch_calls_checking_an_export(tmp_path, layers: int, monkeypatch) -> int:
    """The fnmatch calls checking a Qwen3-MoE export of `layers` layers, which lists one router
    pattern per layer."""
    hf = make_tiny("qwen3_moe", str(tmp_path / f"hf{layers}"), num_hidden_layers=layers, mlp_only_layers=[])
    ck = convert_hf(hf, str(tmp_path / f"ck{layers}"), progress=False)
    run_ptq(
        ParallelState.single(),
        PTQArgs(ck, "nvfp4", str(tmp_path / f"q{layers}"), calib_size=2, seq_len=16, progress=False),
    )
    out = export_hf(str(tmp_path / f"q{layers}"), str(tmp_path / f"e{layers}"), progress=False)
    calls = []
    monkeypatch.setattr(check_exclusions_module, "fnmatchcase", lambda name, p: calls.append(p) or fnmatchcase(name, p))
    assert check_export(out) == []
    return len(calls)


def test_check_export_matches_patterns_in_time_linear_in_the_layers(tmp_path, monkeypatch):
    """Each layer adds as many pattern matches as the one before, not one more per exclusion."""
    two, four, eight = (fnmatch_calls_checking_an_export(tmp_path, n, monkeypatch) for n in (2, 4, 8))
    assert eight - four == 2 * (four - two), (two, four, eight)


# --- engine quirks: warnings that leave the export valid (eprt.hf.check_engine_quirks) -------------
@pytest.mark.parametrize("input_scale", [1.0, 0.01, 1.5 / 2688, 3.7e-3])
def test_the_absorbed_factor_is_nvfp4s_quantization_of_an_identity_matrix(input_scale):
    """vLLM absorbs kv_b_proj through an identity matrix quantized as the layer's NVFP4 inputs:
    ModelOpt's NVFP4 quantizer, given the same input scale, turns its 1.0s into the factor."""
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    eye = torch.eye(32, dtype=torch.bfloat16)
    scale_2 = torch.tensor(input_scale, dtype=torch.float32)
    q, block_scale, _ = qtensor.NVFP4QTensor.quantize(eye, 16, None, scale_2, try_tensorrt=False)
    ones = q.dequantize(torch.float32, scale=block_scale, double_scale=scale_2, block_sizes={-1: 16}).diagonal()
    # equal but for the order of fp32's last rounding (the engine's GEMM has an order of its own)
    assert torch.all(ones == ones[0]) and ones[0].item() == pytest.approx(absorbed_factor(input_scale), rel=1e-6)


def with_kv_b_proj(t: dict, config: dict, hf_quant: dict) -> tuple[dict, dict, dict]:
    """The toy with layer 0's o_proj renamed kv_b_proj, as an MLA layer holds it."""
    old, new = f"{L0}.self_attn.o_proj.", f"{L0}.self_attn.kv_b_proj."
    return {n.replace(old, new): v for n, v in t.items()}, config, hf_quant


@pytest.mark.parametrize("algo", ["NVFP4", "FP8"])
def test_check_warns_of_an_mla_kv_b_proj_in_nvfp4(tmp_path, monkeypatch, capsys, algo):
    t, config, hf_quant = with_kv_b_proj(*toy(algo))
    out = write(tmp_path / "out", t, config, hf_quant)
    warnings = engine_warnings(out)
    if algo == "FP8":  # 8-bit inputs hold the identity matrix's 1.0 exactly
        assert warnings == []
        return
    factor = absorbed_factor(t[f"{L0}.self_attn.kv_b_proj.input_scale"].item())
    assert factor != 1.0
    (line,) = warnings
    assert f"x{factor:.4f} ({L0}.self_attn.kv_b_proj)" in line and '{pattern: "*.kv_b_proj", format: none}' in line
    monkeypatch.setattr(sys, "argv", ["check_export.py", str(out)])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_path(str(TOOL), run_name="__main__")
    assert exit_.value.code == 0  # a warning, not a violation
    assert capsys.readouterr().out.splitlines()[-2:] == [f"warning: {line}", f"{out}: ok"]


def test_no_shipped_recipe_puts_kv_b_proj_in_a_w4a4_format():
    module = "model.layers.1.self_attn.kv_b_proj"
    for name in sorted(f[:-5] for f in os.listdir(RECIPES) if f.endswith(".yaml")):
        fmt = load_recipe(name).format_of(module)
        assert fmt is None or not quantizes_inputs_to_4_bits(weight_format(fmt)), name


@pytest.fixture(scope="module")
def gpt_oss_checkpoint(tmp_path_factory):
    d = tmp_path_factory.mktemp("gpt_oss")
    hf = make_tiny("gpt_oss", str(d / "hf"))
    return json.load(open(os.path.join(hf, "config.json"))), convert_hf(hf, str(d / "ck"), progress=False)


@pytest.mark.parametrize(
    ("recipe", "fmt", "layout"),
    [("int4_g32", "compressed-tensors", "compressed-tensors"), ("mxfp8", "modelopt", "ModelOpt")],
)
def test_check_warns_of_gpt_oss_experts_vllm_does_not_load(gpt_oss_checkpoint, tmp_path, recipe, fmt, layout):
    """vLLM 0.32's GPT-OSS loader takes quantized experts in the release's MXFP4 spelling alone: an
    export with quantized experts in either layout is warned of, every projection of every expert
    counted; the unquantized export, whose experts vLLM loads, is not."""
    config, ck = gpt_oss_checkpoint
    out = export_hf(ck, str(tmp_path / "out"), recipe=recipe, fmt=fmt, progress=False)
    projections = 3 * config["num_local_experts"] * config["num_hidden_layers"]
    (line,) = [w for w in engine_warnings(out) if "GPT-OSS" in w]
    assert line.startswith(
        f"{projections} GPT-OSS routed expert projections are quantized (model.layers.0.mlp.experts."
    )
    assert f"its {layout} MoE methods" in line
    assert engine_warnings(export_hf(ck, str(tmp_path / "bf16"), progress=False)) == []
