"""The compressed-tensors export (`--format compressed-tensors`) against its real clients.

- Its tensors are the ModelOpt export's, renamed and with NVFP4's per-tensor scales inverted
  (weight_global_scale = 1 / weight_scale_2, input_global_scale = 1 / input_scale): the whole
  name set and every value.
- compressed-tensors' own compressors decompress every quantized module to eprt's dequantization
  of the export.
- transformers loads it on CPU through compressed-tensors' decompression
  (`CompressedTensorsConfig(dequantize=True)`: every weight dequantized at load, inputs left in
  bf16, so the input scales are read by no one there) and its logits equal those of the source
  model whose quantized weights are replaced by eprt's own dequantization of the export, within
  bf16 rounding. transformers 5.24 decompresses NVFP4 routed experts without their
  weight_global_scale (its fused-experts path builds a module of weight_packed and weight_scale
  only, so every expert weight comes out global_scale times too large): the test divides the
  loaded experts by the export's weight_global_scale, which is what the library's own
  decompression (above) and vLLM's NVFP4 MoE do.
- eprt-check passes it and names what is broken in it; the export process never imports the
  library (nor transformers).
"""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402
from transformers.utils.quantization_config import CompressedTensorsConfig  # noqa: E402

from eprt.errors import ConfigError  # noqa: E402
from eprt.hf.check_export import check_export  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.formats.fp8 import dequantize_fp8  # noqa: E402
from eprt.quant.formats.nvfp4 import dequantize_nvfp4  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.hf_utils import raw, read_hf_tensors  # noqa: E402

FAMILIES = [
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "deepseek_v32",
    "glm_moe_dsa",
    "qwen3_next",
    "qwen3_5_moe",
    "mistral4",
    "minimax_m2",
    "minimax_m3_vl_text",  # MiniMax-M3's language model (the VLM's, spelled as released, is the same model)
    "llama4",
    "nemotron_h",
    "gpt_oss",
    "deepseek_v4",
]
# transformers' logits as the oracle, not for: the tiny DeepSeek-V3.2 and GLM-5, whose indexer's top-k key
# choice flips with a weight's bf16 rounding; Qwen3.5-MoE, whose causal LM names its modules apart
# from the checkpoint (model.layers, not model.language_model.layers), so the experts' global-scale
# fix-up below cannot find their scales (Qwen3-Next is its text model); MiniMax-M3, whose language
# model transformers loads only with its experts fused (the export writes them per expert, as vLLM
# loads quantized experts); Llama-4's VLM, whose experts transformers holds fused and transposed
# ([E, D, 2I]), which the global-scale fix-up below does not slice; GPT-OSS, whose experts transformers
# holds fused, transposed and interleaved alike; DeepSeek-V4, whose tiny indexer's choice of compressed
# entries, like DeepSeek-V3.2's, flips with a weight's rounding. All are checked by
# compressed-tensors' own decompression.
LOGIT_FAMILIES = ["qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next", "minimax_m2"]
RECIPES = ["fp8", "nvfp4", "nvfp4_experts_fp8_attention"]
CT_NAMES = {
    "fp8": {"weight": "weight", "weight_scale": "weight_scale", "input_scale": "input_scale"},
    "nvfp4": {
        "weight": "weight_packed",
        "weight_scale": "weight_scale",
        "weight_scale_2": "weight_global_scale",
        "input_scale": "input_global_scale",
    },
}
INVERTED = ("weight_global_scale", "input_global_scale")


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(family, recipe) -> (source dir, ModelOpt export, compressed-tensors export), one calibration each."""
    d = tmp_path_factory.mktemp("ct")
    out = {}
    for family in FAMILIES:
        hf = make_tiny(family, str(d / family / "hf"))
        ck = convert_hf(hf, str(d / family / "ck"), progress=False)
        for recipe in RECIPES:
            q = str(d / family / recipe)
            run_ptq(
                ParallelState.single(), PTQArgs(ck, recipe, q, kv_cache="fp8", calib_size=2, seq_len=16, progress=False)
            )
            out[family, recipe] = (
                hf,
                export_hf(q, q + "-modelopt", progress=False),
                export_hf(q, q + "-ct", progress=False, fmt="compressed-tensors"),
            )
    return out


def expected_from_modelopt(modelopt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors the ModelOpt export's values make, by name."""
    quantized = {n[: -len(".input_scale")] for n in modelopt if n.endswith(".input_scale")}
    fmt = {m: "nvfp4" if f"{m}.weight_scale_2" in modelopt else "fp8" for m in quantized}
    out = {}
    for name, t in modelopt.items():
        module, _, leaf = name.rpartition(".")
        if leaf in ("k_scale", "v_scale"):  # self_attn.k_proj.k_scale -> self_attn.k_scale
            out[f"{module.rpartition('.')[0]}.{leaf}"] = t.reshape(1)
        elif module in quantized and leaf != "bias":  # a bias (GLM's q/k/v) is the source's in both layouts
            ct_leaf = CT_NAMES[fmt[module]][leaf]
            if ct_leaf in INVERTED:
                t = 1 / t
            out[f"{module}.{ct_leaf}"] = t.reshape(1) if t.dim() == 0 else t
        else:
            out[name] = t
    return out


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_the_tensors_are_the_modelopt_exports_values(exports, family, recipe):
    _, modelopt, ct = exports[family, recipe]
    want, got = expected_from_modelopt(read_hf_tensors(modelopt)), read_hf_tensors(ct)
    assert set(got) == set(want), (sorted(set(got) - set(want)), sorted(set(want) - set(got)))
    for name in sorted(want):
        assert got[name].dtype == want[name].dtype and got[name].shape == want[name].shape, name
        assert raw(got[name]) == raw(want[name]), name


@pytest.mark.parametrize(
    "recipe, fmt, groups",
    [
        ("fp8", "float-quantized", ["float-quantized"]),
        ("nvfp4", "nvfp4-pack-quantized", ["nvfp4-pack-quantized"]),
        ("nvfp4_experts_fp8_attention", "mixed-precision", ["float-quantized", "nvfp4-pack-quantized"]),
    ],
)
def test_the_config_is_compressed_tensors(exports, recipe, fmt, groups):
    _, _, ct = exports["qwen3_moe", recipe]
    qc = json.loads(Path(ct, "config.json").read_text())["quantization_config"]
    assert not Path(ct, "hf_quant_config.json").exists()
    assert (qc["quant_method"], qc["format"], qc["quantization_status"]) == ("compressed-tensors", fmt, "compressed")
    assert [g["format"] for g in qc["config_groups"].values()] == groups
    assert qc["kv_cache_scheme"]["num_bits"] == 8 and qc["kv_cache_scheme"]["type"] == "float"
    # every Linear left in bf16 (routers, lm_head) is ignored by exact name
    assert {"lm_head", "model.layers.0.mlp.gate"} <= set(qc["ignore"])


def dequantized_source(hf: str, modelopt: str, out: Path) -> str:
    """The source directory with each quantized weight replaced by eprt's dequantization of the
    ModelOpt export (bf16): the model the quantized export stands for."""
    shutil.copytree(hf, out, ignore=shutil.ignore_patterns("*.safetensors", "*.index.json"))
    t = read_hf_tensors(modelopt)
    weights = {}
    for name, w in read_hf_tensors(hf).items():
        module = name[: -len(".weight")]
        weights[name] = eprt_dequantized(t, module) if f"{module}.input_scale" in t else w
    save_file(weights, str(out / "model.safetensors"))
    return str(out)


def eprt_dequantized(t: dict[str, torch.Tensor], module: str) -> torch.Tensor:
    """A quantized module's weight from the ModelOpt export's tensors, by eprt's dequantization (bf16)."""
    if f"{module}.weight_scale_2" in t:
        return dequantize_nvfp4(
            t[f"{module}.weight"], t[f"{module}.weight_scale"], t[f"{module}.weight_scale_2"], torch.bfloat16
        )
    return dequantize_fp8(t[f"{module}.weight"], t[f"{module}.weight_scale"], torch.bfloat16)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_compressed_tensors_decompresses_every_module_to_eprts_values(exports, family, recipe):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    _, modelopt, ct = exports[family, recipe]
    from compressed_tensors.utils.match import match_name

    qc = QuantizationConfig.model_validate(json.loads(Path(ct, "config.json").read_text())["quantization_config"])
    theirs, ours = read_hf_tensors(ct), read_hf_tensors(modelopt)
    modules = sorted(n[: -len(".input_scale")] for n in ours if n.endswith(".input_scale"))
    assert any(".experts." in m for m in modules)
    for module in modules:
        # the group compressed-tensors gives the module: the first whose targets match it
        scheme = next(
            g for g in qc.config_groups.values() if any(t == "Linear" or match_name(module, t) for t in g.targets)
        )
        compressor = BaseCompressor.get_value_from_registry(scheme.format)
        state = {
            leaf: theirs[f"{module}.{leaf}"]
            for leaf in compressor.compression_param_names(scheme)
            if f"{module}.{leaf}" in theirs
        }
        weight = compressor.decompress(state, scheme)["weight"]
        # the same values but for bf16 rounding (compressed-tensors divides by the global scale)
        torch.testing.assert_close(
            weight.to(torch.bfloat16), eprt_dequantized(ours, module), rtol=2**-7, atol=0, msg=module
        )


@pytest.mark.parametrize("family", LOGIT_FAMILIES)
@pytest.mark.parametrize("recipe", RECIPES)
def test_transformers_decompresses_it_to_eprts_values(exports, family, recipe, tmp_path):
    hf, modelopt, ct = exports[family, recipe]
    ids = torch.randint(0, 500, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(
            ct, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True)
        )
        if recipe != "fp8":
            apply_expert_global_scales(model, read_hf_tensors(ct))
        loaded = model(ids).logits
        ref_dir = dequantized_source(hf, modelopt, tmp_path / "ref")
        ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.bfloat16)(ids).logits
        source = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)(ids).logits
    error = (loaded.float() - ref.float()).abs().max().item()
    quantization_error = (source.float() - ref.float()).abs().max().item()
    # two bf16 ulps of the largest logit: the weights agree but for bf16 rounding (the reciprocal
    # global scales divide where ModelOpt's scales multiply)
    tolerance = 2**-6 * ref.float().abs().max().item()
    assert error <= tolerance, (error, tolerance, quantization_error)
    assert error < quantization_error / 2  # far closer to eprt's values than the unquantized model is


# How a checkpoint spells a routed expert's (gate, up, down) projections, by what transformers names
# its MoE block `mlp`: its own spelling, or MiniMax-M2's `block_sparse_moe.experts.E.w1/w3/w2`.
EXPERT_SPELLINGS = {"mlp.": ("gate_proj", "up_proj", "down_proj"), "block_sparse_moe.": ("w1", "w3", "w2")}


def apply_expert_global_scales(model, tensors: dict[str, torch.Tensor]) -> None:
    """Divide each routed expert's weights by its weight_global_scale, which transformers 5.24's
    fused-experts decompression leaves out (see the module doc)."""
    for name, module in model.named_modules():
        if not hasattr(module, "gate_up_proj"):
            continue
        width = module.gate_up_proj.shape[1] // 2
        stored, projections = next(
            (name.replace("mlp.", block), p)
            for block, p in EXPERT_SPELLINGS.items()
            if f"{name.replace('mlp.', block)}.0.{p[0]}.weight_global_scale" in tensors
        )
        for e in range(module.gate_up_proj.shape[0]):
            g = {
                k: tensors[f"{stored}.{e}.{p}.weight_global_scale"].item()
                for k, p in zip(("gate_proj", "up_proj", "down_proj"), projections)
            }
            module.gate_up_proj[e, :width] = (module.gate_up_proj[e, :width].float() / g["gate_proj"]).bfloat16()
            module.gate_up_proj[e, width:] = (module.gate_up_proj[e, width:].float() / g["up_proj"]).bfloat16()
            module.down_proj[e] = (module.down_proj[e].float() / g["down_proj"]).bfloat16()


@pytest.fixture(scope="module")
def ct_export(exports):
    return exports["deepseek_v3", "nvfp4"]


def test_check_passes_every_export(exports):
    for (family, recipe), (hf, modelopt, ct) in exports.items():
        assert check_export(ct, hf) == [], (family, recipe)
        assert check_export(ct) == [], (family, recipe)


def broken_copy(src: str, dst: Path, edit_tensors=None, edit_config=None) -> str:
    shutil.copytree(src, dst)
    if edit_tensors:
        files = sorted(dst.glob("*.safetensors"))
        for f in files:
            t = read_hf_tensors_file(f)
            if edit_tensors(t):
                save_file(t, str(f), metadata={"format": "pt"})
    if edit_config:
        config = json.loads((dst / "config.json").read_text())
        edit_config(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    return str(dst)


def read_hf_tensors_file(f: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(f))


Q = "model.layers.0.self_attn.q_a_proj"


def scale_times(name, factor):
    def edit(t):
        if name in t:
            t[name] = t[name] * factor
            return True

    return edit


def drop(name):
    def edit(t):
        return t.pop(name, None) is not None

    return edit


def unignore(entry):
    def edit(qc):
        qc["ignore"].remove(entry)

    return edit


@pytest.mark.parametrize(
    "edit_tensors, edit_config, fault",
    [
        (scale_times(f"{Q}.weight_global_scale", 2), None, f"{Q}.weight_global_scale"),
        (
            scale_times("model.layers.1.mlp.experts.3.up_proj.input_global_scale", 2),
            None,
            "model.layers.1.mlp.experts.3.up_proj.input_global_scale",
        ),
        (drop(f"{Q}.input_global_scale"), None, f"{Q}.input_global_scale: missing"),
        (drop("model.layers.2.self_attn.k_scale"), None, "model.layers.2.self_attn.k_scale: missing"),
        (scale_times(f"{Q}.weight_global_scale", -1), None, f"{Q}.weight_global_scale"),
        (None, unignore("lm_head"), "lm_head: its config group is nvfp4-pack-quantized"),
        (None, lambda qc: qc.update(quantization_status="frozen"), "quantization_status"),
        (None, lambda qc: qc["config_groups"]["group_0"].update(format="naive-quantized"), "group_0.format"),
    ],
)
def test_check_names_the_fault(ct_export, tmp_path, edit_tensors, edit_config, fault):
    hf, _, ct = ct_export
    problems = check_export(broken_copy(ct, tmp_path / "broken", edit_tensors, edit_config), hf)
    assert any(fault in p for p in problems), problems


def test_an_unknown_format_is_refused(exports, tmp_path):
    _, modelopt, _ = exports["qwen3_moe", "fp8"]
    calibrated = modelopt[: -len("-modelopt")]
    with pytest.raises(ConfigError, match="--format 'gguf'"):
        export_hf(calibrated, str(tmp_path / "out"), progress=False, fmt="gguf")
    assert not (tmp_path / "out").exists()


def test_the_tools_write_and_check_it(exports, tmp_path):
    import os
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[2]
    _, modelopt, _ = exports["qwen3_moe", "nvfp4"]
    out = str(tmp_path / "out")
    env = {**os.environ, "PYTHONPATH": str(root)}
    written = subprocess.run(
        [
            sys.executable,
            "-X",
            "importtime",  # every module the export imports, on stderr
            str(root / "tools" / "export_hf.py"),
            modelopt[: -len("-modelopt")],
            out,
            "--format",
            "compressed-tensors",
            "--no-progress",
        ],
        check=True,
        env=env,
        capture_output=True,
        text=True,
    )
    # the layout's config is eprt's own: the export leaves the library (and transformers) unimported
    imported = {
        line.rpartition("|")[2].strip() for line in written.stderr.splitlines() if line.startswith("import time")
    }
    assert "eprt.hf.compressed_tensors_export" in imported
    assert not {m for m in imported if m.split(".")[0] in ("compressed_tensors", "transformers")}
    assert (
        json.loads(Path(out, "config.json").read_text())["quantization_config"]["quant_method"] == "compressed-tensors"
    )
    check = subprocess.run(
        [sys.executable, str(root / "tools" / "check_export.py"), out], capture_output=True, text=True, env=env
    )
    *warnings, verdict = check.stdout.strip().splitlines()
    assert (check.returncode, verdict) == (0, f"{out}: ok")
    # the one quirk this layout runs into: transformers' decompression of NVFP4 experts (the engines load it)
    assert len(warnings) == 1 and warnings[0].startswith("warning: ") and "transformers 5 decompresses" in warnings[0]
