"""A shipped recipe means what its name says in every family: `nvfp4_experts_fp8_attention`'s
`*.self_attn.*` names Nemotron-H's attention, a layer's `mixer` (eprt.families.Family.recipe_aliases),
and nothing else there (Mamba's in_proj/out_proj, the MLPs, the shared experts stay unquantized)."""

import json
import re
from pathlib import Path

import torch

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.recipe import load_recipe
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.hf_utils import read_hf_tensors

FP8 = ("weight", "weight_scale", "input_scale")
NVFP4 = ("weight", "weight_scale", "weight_scale_2", "input_scale")
ATTENTION = re.compile(r"backbone\.layers\.\d+\.mixer\.[qkvo]_proj")
EXPERT = re.compile(r"backbone\.layers\.\d+\.mixer\.experts\.\d+\.(up|down)_proj")


def test_self_attn_rules_name_every_familys_attention_and_nothing_else():
    recipe = load_recipe("nvfp4_experts_fp8_attention")
    assert recipe.format_of("backbone.layers.2.mixer.q_proj") == "fp8"
    assert recipe.format_of("language_model.backbone.layers.2.mixer.o_proj") == "fp8"
    assert recipe.format_of("model.layers.0.self_attn.q_proj") == "fp8"
    for other in (
        "backbone.layers.0.mixer.in_proj",
        "backbone.layers.3.mixer.up_proj",
        "backbone.layers.1.mixer.shared_experts.up_proj",
        "model.layers.0.linear_attn.in_proj_qkvz",
        "model.layers.0.mlp.gate_proj",
    ):
        assert recipe.format_of(other) is None, other


def test_nemotron_hs_attention_exports_in_fp8_under_nvfp4_experts_fp8_attention(tmp_path):
    """The whole export predicted from the source: the attention mixers' q/k/v/o in FP8 with their
    scales, the routed experts in NVFP4, every other tensor as the source holds it (the MTP layers
    carried whole); the ModelOpt config names each attention projection FP8; eprt-check passes."""
    hf = make_tiny("nemotron_h", str(tmp_path / "hf"))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    q = str(tmp_path / "q")
    args = PTQArgs(ck, "nvfp4_experts_fp8_attention", q, calib_size=2, seq_len=16, eval_size=0, progress=False)
    run_ptq(ParallelState.single(), args)
    out = export_hf(q, q + "-hf", progress=False)
    source, got = read_hf_tensors(hf), read_hf_tensors(out)

    want = {}
    for name, t in source.items():
        module = name.removesuffix(".weight")
        leaves = FP8 if ATTENTION.fullmatch(module) else NVFP4 if EXPERT.fullmatch(module) else None
        if leaves is None:
            want[name] = t.dtype
        else:
            want.update({f"{module}.{leaf}": None for leaf in leaves})
    assert set(got) == set(want)
    attention = sorted({n.removesuffix(".weight") for n in source if ATTENTION.fullmatch(n.removesuffix(".weight"))})
    assert attention == sorted(f"backbone.layers.2.mixer.{p}_proj" for p in "qkvo")  # the one attention layer
    for module in attention:
        assert got[f"{module}.weight"].dtype == torch.float8_e4m3fn
    for name, dtype in want.items():
        if dtype is not None:
            assert torch.equal(got[name], source[name]), name
    layers = json.loads((Path(out) / "hf_quant_config.json").read_text())["quantization"]["quantized_layers"]
    assert {m for m, v in layers.items() if v["quant_algo"] == "FP8"} == set(attention)
    assert check_export(str(out), hf) == []
