"""The quantized export of DeepSeek-V3's multi-token-prediction layer (`model.layers.3` of the tiny
model): a recipe with `mtp: true` quantizes its attention and experts, calibrated on the last
decoder layer's hidden states; every other recipe writes it back byte for byte."""

import json
import os
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from safetensors import safe_open

from eprt.errors import ConfigError
from eprt.hf.check_export import check_export
from eprt.hf.check_names import check_names
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.calibrated import CalibrationRecord
from eprt.quant.feasibility import RecipeError
from eprt.quant.formats.fp8 import FP8
from eprt.quant.formats.nvfp4 import nvfp4_scale
from eprt.quant.recipe import parse_recipe
from eprt.quant.run.planner import Planner
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.run.setup import plan_recipe
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.ep_checks import same_files
from tests.hf_utils import raw, read_hf_tensors
from tests.multiproc import free_port, run_world

MTP = "model.layers.3"  # the tiny DeepSeek-V3 has 3 decoder layers and one MTP layer
RECIPE = "nvfp4_experts_fp8_attention_mtp"
CALIB = dict(kv_cache="fp8", calib_size=6, seq_len=16, batch_size=2, progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp-export")
    hf = make_tiny("deepseek_v3", str(d / "hf"))
    return d, hf, convert_hf(hf, str(d / "ck"), progress=False)


@pytest.fixture(scope="module")
def calibrated(tiny):
    d, hf, ck = tiny
    q = str(d / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, RECIPE, q, **CALIB))
    return q, export_hf(q, str(d / "q-hf"), progress=False)


def tensors(out: str) -> dict[str, torch.Tensor]:
    got = {}
    for shard in sorted(set(json.loads(Path(out, "model.safetensors.index.json").read_text())["weight_map"].values())):
        with safe_open(os.path.join(out, shard), framework="pt") as f:
            got.update({n: f.get_tensor(n) for n in f.keys()})
    return got


def test_the_mtp_layer_is_quantized_as_the_recipe_says(tiny, calibrated):
    """Attention FP8 and routed experts NVFP4 (per expert, under the source's names), with the
    MTP layer's KV scales; eh_proj, its embedding, shared head, router and shared experts stay as
    the source holds them. The configs say exactly that."""
    _, hf, _ = tiny
    _, out = calibrated
    got, source = tensors(out), read_hf_tensors(hf)
    assert check_export(out, hf) == []
    assert got[f"{MTP}.self_attn.q_a_proj.weight"].dtype == torch.float8_e4m3fn
    assert got[f"{MTP}.mlp.experts.5.down_proj.weight"].dtype == torch.uint8
    assert got[f"{MTP}.self_attn.k_proj.k_scale"] > 0 and got[f"{MTP}.self_attn.v_proj.v_scale"] > 0
    for leaf in (
        "eh_proj.weight",
        "embed_tokens.weight",
        "shared_head.head.weight",
        "mlp.gate.weight",
        "mlp.shared_experts.up_proj.weight",
        "enorm.weight",
    ):
        assert raw(got[f"{MTP}.{leaf}"]) == raw(source[f"{MTP}.{leaf}"]), leaf
    quant = json.loads(Path(out, "hf_quant_config.json").read_text())["quantization"]
    layers = quant["quantized_layers"]
    assert layers[f"{MTP}.mlp.experts"] == {"quant_algo": "NVFP4", "group_size": 16}
    assert {m for m in layers if m.startswith(MTP + ".")} == {f"{MTP}.mlp.experts"} | {
        f"{MTP}.self_attn.{p}" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    }
    assert "exclude_modules" not in quant  # nothing travels through whole any more


def test_a_single_format_recipe_excludes_the_mtp_modules_it_leaves_by_name(tiny, tmp_path):
    d, hf, ck = tiny
    recipe = tmp_path / "fp8_mtp.yaml"
    recipe.write_text('name: fp8_mtp\nquantize:\n  - {pattern: "*", format: fp8}\nmtp: true\n')
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, str(recipe), q, **CALIB))
    out = export_hf(q, str(tmp_path / "q-hf"), progress=False)
    assert check_export(out, hf) == []
    excluded = json.loads(Path(out, "hf_quant_config.json").read_text())["quantization"]["exclude_modules"]
    assert sorted(e for e in excluded if e.startswith(MTP)) == [
        f"{MTP}.eh_proj",
        f"{MTP}.embed_tokens",
        f"{MTP}.mlp.gate",
        f"{MTP}.shared_head*",
    ]
    assert json.loads(Path(out, "config.json").read_text())["quantization_config"]["ignore"] == excluded


def test_the_mtp_experts_input_scales_come_from_the_mtp_calibration(calibrated):
    """The MTP layer ran on the last layer's hidden states: its experts' input amax are its own
    (not zero, not the last decoder layer's), and every expert's input_scale is the layer's max."""
    q, out = calibrated
    with Checkpoint(q) as ck:
        record = CalibrationRecord.read(ck)
    mtp_w13, mtp_w2 = record.expert_input_amax[f"{MTP}.mlp.experts"]
    last_w13, _ = record.expert_input_amax["model.layers.2.mlp.experts"]
    assert mtp_w13.max() > 0 and mtp_w2.max() > 0
    assert not torch.equal(mtp_w13, last_w13)
    got = tensors(out)
    for e in range(8):
        assert torch.equal(got[f"{MTP}.mlp.experts.{e}.gate_proj.input_scale"], nvfp4_scale(mtp_w13.max()))
        assert torch.equal(got[f"{MTP}.mlp.experts.{e}.down_proj.input_scale"], nvfp4_scale(mtp_w2.max()))
    assert not torch.equal(
        got[f"{MTP}.mlp.experts.0.gate_proj.input_scale"], got["model.layers.2.mlp.experts.0.gate_proj.input_scale"]
    )


def _calibrate(ck: str, out: str, port: int) -> None:
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, PTQArgs(ck, RECIPE, out, **CALIB))


def test_the_export_is_the_same_bytes_at_world_2_ep_2(tiny, calibrated, tmp_path):
    """Each rank runs the MTP layer on its own sequences with its own experts: the export is the
    single process's, byte for byte."""
    _, _, ck = tiny
    _, single = calibrated
    q = str(tmp_path / "q-w2")
    run_world(_calibrate, 2, ck, q, free_port(), timeout=200)
    assert same_files(single, export_hf(q, str(tmp_path / "q-w2-hf"), progress=False))


def test_a_default_recipe_writes_the_mtp_layer_back_byte_for_byte(tiny, tmp_path):
    d, hf, ck = tiny
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, "nvfp4_experts_fp8_attention", q, **CALIB))
    out = export_hf(q, str(tmp_path / "q-hf"), progress=False)
    got, source = tensors(out), read_hf_tensors(hf)
    mtp = {n for n in source if n.startswith(MTP + ".")}
    assert {n for n in got if n.startswith(MTP + ".")} == mtp  # no scale, no KV scale
    for name in mtp:
        assert raw(got[name]) == raw(source[name]), name
    quant = json.loads(Path(out, "hf_quant_config.json").read_text())["quantization"]
    assert quant["exclude_modules"] == [f"{MTP}.*"]
    assert not [m for m in quant["quantized_layers"] if m.startswith(MTP)]


def test_a_block_fp8_source_quantizes_its_mtp_layer_from_the_decoded_weights(tmp_path):
    """DeepSeek-V3 as released stores the MTP layer in block FP8: quantized from the decoded
    weights; what stays unquantized is written decoded (bf16)."""
    hf = make_tiny("deepseek_v3", str(tmp_path / "hf"), source_format="fp8-block")
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, RECIPE, q, **CALIB))
    out = export_hf(q, str(tmp_path / "q-hf"), progress=False)
    assert check_export(out, hf) == []
    got = tensors(out)
    assert got[f"{MTP}.mlp.experts.0.gate_proj.weight"].dtype == torch.uint8
    assert got[f"{MTP}.mlp.shared_experts.gate_proj.weight"].dtype == torch.bfloat16
    assert not [n for n in got if n.endswith("weight_scale_inv")]


@pytest.mark.parametrize("family", ["deepseek_v32", "glm_moe_dsa"])
def test_dsa_mtp_is_refused_by_name(tmp_path, family):
    """DeepSeek-V3.2's and GLM-5's MTP layer (its attention has the DSA indexer) is carried through;
    eprt does not run it, so a recipe asking to quantize it is refused before anything is read."""
    hf = make_tiny(family, str(tmp_path / "hf"))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    with (
        pytest.raises(
            RecipeError,
            match=r"mtp: true.*does not run this model's multi-token-prediction layers "
            r"\(model\.layers\.\d+.*remove `mtp: true`",
        ),
        Checkpoint(ck) as c,
    ):
        plan_recipe(ResolvedCheckpoint.of(c, torch.bfloat16), RECIPE)


def test_mtp_recipes_that_cannot_mean_it_are_refused(tiny, tmp_path):
    _, _, ck = tiny
    # mtp: true, but no rule reaches a module of the MTP layer
    only_decoder = tmp_path / "decoder.yaml"
    only_decoder.write_text('quantize:\n  - {pattern: "model.layers.[0-2].*", format: fp8}\nmtp: true\n')
    with (
        pytest.raises(RecipeError, match=rf"quantizes no module of the multi-token-prediction layer {MTP}"),
        Checkpoint(ck) as c,
    ):
        plan_recipe(ResolvedCheckpoint.of(c, torch.bfloat16), str(only_decoder))
    with pytest.raises(ConfigError, match=r"mtp 'yes'; write true"):
        parse_recipe({"quantize": [{"pattern": "*", "format": "fp8"}], "mtp": "yes"}, "r.yaml")


def test_eprt_check_refuses_a_quantized_eh_proj_or_shared_head():
    """vLLM and SGLang build an MTP layer's eh_proj as a plain torch Linear and its shared head as an
    lm head: a quantized one cannot load, whatever the configs say."""
    for module, leaf in ((f"{MTP}.eh_proj", "eh_proj"), (f"{MTP}.shared_head.head", "shared_head.head")):
        tensors = {f"{module}.{c}": SimpleNamespace(dtype="F32") for c in FP8.modelopt_leaves}
        problems = []
        check_names(tensors, {module: FP8.modelopt_leaves}, (), None, problems)
        assert problems == [
            f"{module}.weight: quantized, but vLLM and SGLang build a multi-token-prediction "
            f"layer's {leaf} unquantized and cannot load it; keep it in the source dtype"
        ]


def test_the_memory_plan_prices_the_mtp_layer_a_recipe_runs(tiny):
    """Loaded whole, with its own embedding and shared head, the MTP layer is the tiny model's
    largest: the plan of a recipe that runs it holds its bytes (its routed experts shared by ep)."""
    _, hf, ck = tiny
    fp32 = ("mlp.gate.weight", "mlp.gate.e_score_correction_bias")  # the router computes in fp32
    size = {
        n: t.numel() * (4 if n.endswith(fp32) else 2) for n, t in read_hf_tensors(hf).items() if n.startswith(MTP + ".")
    }
    experts = sum(v for n, v in size.items() if ".experts." in n)
    with Checkpoint(ck) as c:
        plain = Planner.of(ResolvedCheckpoint.of(c, torch.bfloat16), torch.device("cpu"))
        planned = Planner.of(ResolvedCheckpoint.of(c, torch.bfloat16), torch.device("cpu"), mtp=True)
    for ep in (1, 2):
        assert planned._layer(ep)[0] == sum(size.values()) - experts + experts // ep
        assert plain._layer(ep)[0] < planned._layer(ep)[0]


def test_the_compressed_tensors_layout_quantizes_the_mtp_layer_too(tiny, calibrated, tmp_path):
    """The same values in llm-compressor's layout: the MTP layer's unquantized Linears (the recipe
    leaves shared experts unquantized) ignored by name, not the whole layer by prefix."""
    _, hf, _ = tiny
    q, _ = calibrated
    out = export_hf(q, str(tmp_path / "ct"), progress=False, fmt="compressed-tensors")
    assert check_export(out, hf) == []
    qc = json.loads(Path(out, "config.json").read_text())["quantization_config"]
    assert sorted(e for e in qc["ignore"] if MTP in e.replace("\\", "")) == [
        f"{MTP}.eh_proj",
        f"{MTP}.embed_tokens",
        f"{MTP}.mlp.gate",
        *(f"{MTP}.mlp.shared_experts.{p}_proj" for p in ("down", "gate", "up")),
        f"{MTP}.shared_head.head",
    ]
    assert tensors(out)[f"{MTP}.mlp.experts.7.up_proj.weight_packed"].dtype == torch.uint8


def test_the_preview_runs_beside_an_mtp_recipe(tiny, tmp_path):
    """The causal LM the preview fake-quantizes has no MTP layer: its targets are left out there."""
    _, _, ck = tiny
    run_ptq(ParallelState.single(), PTQArgs(ck, RECIPE, str(tmp_path / "q"), preview="Hello", **CALIB))


def test_gptq_quantizes_the_mtp_layer_beside_all_experts_calibration(tiny, calibrated, tmp_path):
    """--algorithm gptq with --calibrate-all-experts and the quality report: GPTQ runs on the MTP
    layer too (its routed experts read from their source tensors), the export writes its codes
    and passes the checks, and differs from max rounding's there."""
    _, hf, ck = tiny
    q = str(tmp_path / "q")
    run_ptq(
        ParallelState.single(),
        PTQArgs(ck, RECIPE, q, algorithm="gptq", gptq_min_tokens=1, calibrate_all_experts=True, **CALIB),
    )
    with Checkpoint(q) as c:
        record = CalibrationRecord.read(c)
        assert c.quantization["calibration"]["all_experts"] is True
    gptq = record.parts["gptq"]
    assert f"{MTP}.mlp.experts" in gptq.experts and f"{MTP}.self_attn.o_proj" in gptq.dense
    out = export_hf(q, str(tmp_path / "q-hf"), progress=False)
    assert check_export(out, hf) == []
    got, plain = tensors(out), tensors(calibrated[1])
    # the weight scales follow from the weights alone: the codes differ by GPTQ's rounding
    for name in (f"{MTP}.self_attn.o_proj.weight", f"{MTP}.mlp.experts.5.down_proj.weight"):
        assert raw(got[name.replace("weight", "weight_scale")]) == raw(plain[name.replace("weight", "weight_scale")])
        assert raw(got[name]) != raw(plain[name]), name
