"""Mixed-precision recipes: which format each module gets, the refusals, and the checks of a
mixed ModelOpt export (its bytes and configs against ModelOpt's own: tests/oracles/test_modelopt_oracle.py;
its whole name set for every family: tests/test_export_names.py)."""

import json
import shutil
from pathlib import Path

import pytest

from eprt.families import parse_hf_config, reader_for
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.feasibility import RecipeError, quantized_modules
from eprt.quant.recipe import load_recipe, parse_recipe
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny


def layout(tmp_path, family):
    hf = make_tiny(family, str(tmp_path / family))
    config = parse_hf_config(json.loads(Path(hf, "config.json").read_text()))
    return reader_for(config.model_type, hf).layout(config)


def test_kimi_k3_release_quantizes_as_the_release(tmp_path):
    recipe = load_recipe("kimi_k3_release")
    formats = {m: recipe.format_of(m) for m in quantized_modules(layout(tmp_path, "kimi_k3"), recipe, "k3")}
    assert formats and all(f == "nvfp4" for m, f in formats.items() if m.endswith(".experts"))
    assert all(f == "fp8" for m, f in formats.items() if ".self_attn." in m)
    assert {f for f in formats.values()} == {"nvfp4", "fp8"}
    # the latent and attention-residual projections, shared experts, vision tower stay unquantized
    assert not [
        m
        for m in formats
        if "routed_expert_" in m
        or "_res_proj" in m
        or "shared_experts" in m
        or m.startswith(("vision_tower", "mm_projector"))
    ]
    assert all(m.endswith(".experts") or ".self_attn." in m for m in formats)


def test_fused_siblings_in_two_formats_are_refused(tmp_path):
    recipe = parse_recipe(
        {"name": "split", "quantize": [{"pattern": "*.q_proj", "format": "fp8"}, {"pattern": "*", "format": "nvfp4"}]},
        "split.yaml",
    )
    with pytest.raises(
        RecipeError,
        match=r"quantizes model\.layers\.0\.self_attn\.q_proj with fp8 but "
        r"model\.layers\.0\.self_attn\.k_proj with nvfp4",
    ):
        quantized_modules(layout(tmp_path, "qwen3_moe"), recipe, "tiny")


def test_a_recipe_without_a_format_is_refused():
    with pytest.raises(Exception, match="at least one format"):
        parse_recipe({"quantize": [{"pattern": "*", "format": "none"}]}, "none.yaml")


@pytest.fixture(scope="module")
def mixed_export(tmp_path_factory):
    d = tmp_path_factory.mktemp("mixed")
    hf = make_tiny("qwen3_moe", str(d / "hf"))
    ck = convert_hf(hf, str(d / "ck"), progress=False)
    run_ptq(
        ParallelState.single(),
        PTQArgs(ck, "nvfp4_experts_fp8_attention", str(d / "q"), calib_size=2, seq_len=16, progress=False),
    )
    return hf, export_hf(str(d / "q"), str(d / "out"), progress=False)


def edited(src: str, dst: Path, edit) -> str:
    shutil.copytree(src, dst)
    for name in ("hf_quant_config.json", "config.json"):
        data = json.loads((dst / name).read_text())
        layers = data["quantization"] if name == "hf_quant_config.json" else data["quantization_config"]
        edit(layers["quantized_layers"])
        (dst / name).write_text(json.dumps(data))
    return str(dst)


Q = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize(
    "edit, fault",
    [
        (
            lambda layers: layers.update({Q: {"quant_algo": "NVFP4", "group_size": 16}}),
            f"{Q}: stored FP8 but quantized_layers says {Q}: NVFP4",
        ),
        (
            lambda layers: layers.pop("model.layers.0.mlp.experts"),
            "model.layers.0.mlp.experts.0.down_proj: stored NVFP4 but quantized_layers says model.layers.0.mlp.experts: "
            "not listed",
        ),
        (
            lambda layers: layers.update({"model.layers.1.mlp.up_proj": {"quant_algo": "FP8"}}),
            "model.layers.1.mlp.up_proj: stored unquantized but quantized_layers says",
        ),
        (
            lambda layers: layers.update({"model.layers.9.self_attn.q_proj": {"quant_algo": "FP8"}}),
            "quantized_layers.model.layers.9.self_attn.q_proj: no such Linear",
        ),
    ],
)
def test_check_names_a_wrong_quantized_layers_entry(mixed_export, tmp_path, edit, fault):
    hf, out = mixed_export
    assert check_export(out, hf) == []
    problems = check_export(edited(out, tmp_path / "broken", edit), hf)
    assert any(fault in p for p in problems), problems


def test_a_rule_for_the_mtp_layers_alone_is_refused_by_name(tmp_path):
    ds = layout(tmp_path, "deepseek_v3")  # 3 decoder layers, MTP layer 3
    for_mtp = parse_recipe(
        {
            "name": "mtp",
            "quantize": [{"pattern": "model.layers.3.*", "format": "fp8"}, {"pattern": "*", "format": "nvfp4"}],
        },
        "mtp.yaml",
    )
    with pytest.raises(
        RecipeError,
        match=r"quantizes model\.layers\.3\.eh_proj .*multi-token-prediction.*"
        r"add `mtp: true` to the recipe",
    ):
        quantized_modules(ds, for_mtp, "tiny")
    # a rule that also matches the model's own modules leaves the MTP layer unquantized
    shipped = load_recipe("nvfp4_experts_fp8_attention")
    assert not [m for m in quantized_modules(ds, shipped, "tiny") if m.startswith("model.layers.3.")]
    # unless the recipe says mtp: true; eh_proj, the MTP layer's embedding and shared head stay unquantized
    with_mtp = load_recipe("nvfp4_experts_fp8_attention_mtp")
    assert [m for m in quantized_modules(ds, with_mtp, "tiny") if m.startswith("model.layers.3.")] == [
        f"model.layers.3.self_attn.{p}" for p in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
    ] + ["model.layers.3.mlp.experts"]
