"""DeepSeek-V4's attention (`attn`) under the recipes that quantize `*.self_attn.*`: the Linears vLLM's
V4 builds quantizable (wq_a, wkv, wq_b, wo_b, the indexer's wq_b) take the attention's format,
wo_a, the compressors and the indexer's weights_proj stay as the source holds them, and the mixed
precision configs name each module as the export's tensors do, the release's flat names
(`layers.N.ffn.experts`, not eprt's `model.layers.N.ffn.experts`)."""

import json
import re
from pathlib import Path

import pytest
import torch

from bench.export_digests import MIXED, recipe_file, wide
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.recipe import load_recipe
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny, released
from tests.hf_utils import raw, read_hf_tensors
from tests.test_deepseek_v4_recipes import BOUND, library_error, quant_config

FP8 = ("weight", "weight_scale", "input_scale")
NVFP4 = ("weight", "weight_scale", "weight_scale_2", "input_scale")
ATTENTION = re.compile(r"layers\.\d+\.attn\.(wq_a|wq_b|wkv|wo_b|indexer\.wq_b)")
EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]")


def calibrated(hf: str, tmp: Path, recipe: str) -> str:
    ck = convert_hf(hf, str(tmp / "ck"), progress=False)
    q = str(tmp / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, recipe, q, calib_size=2, seq_len=16, eval_size=0, progress=False))
    return q


def test_the_recipe_names_v4s_attention_and_nothing_else_of_it():
    recipe = load_recipe("nvfp4_experts_fp8_attention")
    for leaf in ("wq_a", "wq_b", "wkv", "wo_b", "indexer.wq_b"):
        assert recipe.format_of(f"model.layers.3.attn.{leaf}") == "fp8", leaf
        assert recipe.format_of(f"mtp.0.attn.{leaf}") == "fp8", leaf
    # wo_a is an einsum over its groups in every engine; the compressors' and weights_proj plain matmuls
    for other in ("wo_a", "compressor.wkv", "compressor.wgate", "indexer.weights_proj", "indexer.compressor.wkv"):
        assert recipe.format_of(f"model.layers.3.attn.{other}") is None, other
    assert recipe.format_of("model.layers.3.ffn.shared_experts.w1") is None


def test_v4_as_released_exports_fp8_attention_and_nvfp4_experts(tmp_path):
    """The whole export predicted from the release (FP8 attention and shared expert with E8M0 block
    scales, FP4 experts): the attention Linears in FP8 and the routed experts in NVFP4 with their
    scales, every other encoded weight decoded to bf16 without its scale, every bf16 or fp32 tensor
    as stored (the MTP layer carried unquantized); quantized_layers lists exactly those modules under
    the release's names; eprt-check passes."""
    hf = make_tiny("deepseek_v4", str(tmp_path / "hf"), **released("deepseek_v4"), **wide("deepseek_v4"))
    out = export_hf(calibrated(hf, tmp_path, "nvfp4_experts_fp8_attention"), str(tmp_path / "out"), progress=False)
    source, got = read_hf_tensors(hf), read_hf_tensors(out)

    want: dict[str, torch.dtype | None] = {}  # name -> the dtype of a weight kept as stored, else None
    for name, t in source.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "scale":
            continue
        leaves = FP8 if ATTENTION.fullmatch(module) else NVFP4 if EXPERT.fullmatch(module) else None
        if leaves is not None:
            want.update({f"{module}.{x}": None for x in leaves})
        else:
            want[name] = torch.bfloat16 if f"{module}.scale" in source else t.dtype
    assert set(got) == set(want)
    attention = {m.removesuffix(".weight") for m in source if ATTENTION.fullmatch(m.removesuffix(".weight"))}
    assert {m.rsplit(".", 1)[1] for m in attention} == {"wq_a", "wq_b", "wkv", "wo_b"}  # and the indexer's wq_b
    assert any(".indexer." in m for m in attention)
    for module in attention:
        assert got[f"{module}.weight"].dtype == torch.float8_e4m3fn, module
    for name, dtype in want.items():
        assert dtype is None or got[name].dtype == dtype, name
        if dtype is not None and f"{name.rpartition('.')[0]}.scale" not in source:
            assert raw(got[name]) == raw(source[name]), name
    layers = json.loads((Path(out) / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    experts = {m.rsplit(".", 3)[0] for m in source if EXPERT.fullmatch(m.removesuffix(".weight"))}
    want_layers = {m: "FP8" for m in attention} | {m: "NVFP4" for m in experts}
    assert {m: v["quant_algo"] for m, v in layers.items()} == want_layers
    assert quant_config(out)["quantized_layers"] == layers
    assert check_export(out, hf) == []


@pytest.mark.parametrize("recipe", ["nvfp4_experts_fp8_attention", *MIXED])
def test_v4s_mixed_precision_compressed_tensors_export_decodes(recipe, tmp_path):
    """A mixed-precision export in compressed-tensors' layout: its config's targets name the release's
    modules, eprt-check passes, and the compressed-tensors library decodes every quantized module, the
    attention's among them, to its source weight within the format's rounding."""
    hf = make_tiny("deepseek_v4", str(tmp_path / "hf"), **wide("deepseek_v4"))
    recipe = recipe_file(str(tmp_path), recipe) if recipe in MIXED else recipe
    out = export_hf(calibrated(hf, tmp_path, recipe), str(tmp_path / "ct"), progress=False, fmt="compressed-tensors")
    assert check_export(out, hf) == []
    source, exported, config = read_hf_tensors(hf), read_hf_tensors(out), quant_config(out)
    assert config["format"] == "mixed-precision"
    quantized = {n.removesuffix(".weight_scale") for n in exported if n.endswith(".weight_scale")}
    assert {m for m in quantized if ".attn." in m} == {
        m.removesuffix(".weight") for m in source if ATTENTION.fullmatch(m.removesuffix(".weight"))
    }
    assert {m for m in quantized if ".attn." not in m and ".shared_experts." not in m} == {
        m.removesuffix(".weight") for m in source if EXPERT.fullmatch(m.removesuffix(".weight"))
    }
    for module in sorted(quantized):
        err, bits = library_error(config, exported, module, source[f"{module}.weight"])
        assert err <= BOUND[bits], (module, err)


def test_v4s_unquantized_experts_are_ignored_under_the_releases_names(tmp_path):
    """Attention alone quantized, in compressed-tensors' layout: `ignore` is every other Linear of the
    source by its name, each layer's routed experts as one `re:` prefix of the release's
    `layers.N.ffn.experts`, and the MTP layer carried whole; nothing in it names a module the export lacks."""
    hf = make_tiny("deepseek_v4", str(tmp_path / "hf"), **wide("deepseek_v4"))
    recipe = tmp_path / "attention_only.yaml"
    recipe.write_text(
        "name: attention_only\n"
        'quantize:\n  - {pattern: "*.self_attn.*", format: fp8}\n  - {pattern: "*", format: none}\n'
    )
    out = export_hf(
        calibrated(hf, tmp_path, str(recipe)), str(tmp_path / "ct"), progress=False, fmt="compressed-tensors"
    )
    assert check_export(out, hf) == []
    source = read_hf_tensors(hf)
    linears = {n.removesuffix(".weight") for n, t in source.items() if n.endswith(".weight") and t.dim() == 2}
    layers = sorted({m.split(".")[1] for m in linears if EXPERT.fullmatch(m)})
    want = {m for m in linears if not (ATTENTION.fullmatch(m) or EXPERT.fullmatch(m) or m.startswith("mtp."))}
    want |= {rf"re:^layers\.{i}\.ffn\.experts\." for i in layers} | {r"re:^mtp\."}
    assert quant_config(out)["ignore"] == sorted(want)


def test_wq_a_and_wkv_share_nvfp4s_per_tensor_scales(tmp_path):
    """vLLM loads wq_a and wkv as one Linear (`fused_wqa_wkv`) with one weight_scale_2 and one
    input_scale: under NVFP4 every layer's pair is exported with the same ones."""
    hf = make_tiny("deepseek_v4", str(tmp_path / "hf"), **wide("deepseek_v4"))
    out = export_hf(calibrated(hf, tmp_path, "nvfp4"), str(tmp_path / "out"), progress=False)
    got = read_hf_tensors(out)
    layers = sorted({n.rsplit(".attn.", 1)[0] for n in got if n.endswith(".attn.wq_a.weight_scale_2")})
    assert len(layers) == 4  # the tiny model's decoder layers (its MTP layer carried unquantized)
    for layer in layers:
        for leaf in ("weight_scale_2", "input_scale"):
            assert torch.equal(got[f"{layer}.attn.wq_a.{leaf}"], got[f"{layer}.attn.wkv.{leaf}"]), (layer, leaf)
