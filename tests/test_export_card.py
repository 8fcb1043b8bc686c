"""A quantized export holds what belongs to the quantized model: the files serving it reads and its own
model card, not the source's card, data or images; the card names the base model, the recipe's
formats, the GPUs and the serve commands of the engines that load its layout (eprt.hf.serving, whose
table is README's); eprt-check checks a compressed-tensors export without the library."""

import json
import os
import sys

import pytest

from eprt.commands.check import check
from eprt.errors import ConfigError
from eprt.hf.check_engine_quirks import engine_warnings
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.hf.serving import TABLE, check_target, format_table, generation_of
from eprt.parallel import ParallelState
from eprt.quant.formats import WEIGHT_FORMATS
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a downloaded model directory holds beside its weights and configs
DESCRIBES_THE_SOURCE = {"README.md": "# the bf16 model\n", "calib.jsonl": '{"text": "x"}\n', "eval.txt": "y\n"}
SERVES_IT = {"LICENSE": "MIT\n", "modeling_tiny.py": "# its own code\n"}


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    d = tmp_path_factory.mktemp("card")
    hf = make_tiny("qwen3_moe", str(d / "hf"))
    config = json.load(open(os.path.join(hf, "config.json")))
    json.dump({**config, "_name_or_path": "tiny-org/Tiny-MoE"}, open(os.path.join(hf, "config.json"), "w"))
    for name, text in {**DESCRIBES_THE_SOURCE, **SERVES_IT}.items():
        with open(os.path.join(hf, name), "w") as f:
            f.write(text)
    ck = convert_hf(hf, str(d / "ck"), progress=False, reference=True)
    q = str(d / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, "nvfp4", q, calib_size=4, seq_len=16, eval_size=2, progress=False))
    return hf, q


def test_the_export_holds_its_card_and_what_serving_reads_only(calibrated, tmp_path):
    hf, q = calibrated
    out = export_hf(q, str(tmp_path / "out"), progress=False)
    source = set(os.listdir(hf))
    assert set(os.listdir(out)) == {
        *(source - set(DESCRIBES_THE_SOURCE) - {"model.safetensors"}),
        "README.md",  # its own card
        "hf_quant_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "eprt_quality.json",
        "eprt_quality.html",
    }
    card = open(os.path.join(out, "README.md")).read()
    assert card.startswith("---\nbase_model: tiny-org/Tiny-MoE\nbase_model_relation: quantized\n")
    assert "| `model.layers.*.mlp.experts` | 2 | nvfp4 |" in card  # the two MoE layers, one group
    assert "Runs as calibrated on Blackwell" in card and "Hopper" not in card
    for command in ("vllm serve $MODEL", "python -m sglang.launch_server", "trtllm-serve $MODEL"):
        assert command in card
    assert "top-1 agreement" in card and str(tmp_path) not in card  # nothing of this machine


def test_the_card_serves_the_compressed_tensors_layout_with_its_engines(calibrated, tmp_path):
    _, q = calibrated
    out = export_hf(q, str(tmp_path / "out"), progress=False, fmt="compressed-tensors", base_model="me/Tiny-NVFP4")
    card = open(os.path.join(out, "README.md")).read()
    assert "base_model: me/Tiny-NVFP4" in card and "compressed-tensors layout" in card
    assert "--quantization modelopt_fp4" not in card  # SGLang reads the layout from its config
    # transformers misreads its NVFP4 experts: said at export, with the engine to verify with
    (warning,) = engine_warnings(out)
    assert "NVFP4 routed expert" in warning and "verify it in vLLM" in warning


def test_check_without_the_library_checks_with_eprts_table(calibrated, tmp_path, monkeypatch, capsys):
    _, q = calibrated
    out = export_hf(q, str(tmp_path / "out"), progress=False, fmt="compressed-tensors")
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # not installed
    assert check([out]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("note: the compressed-tensors library is not installed")
    assert lines[-1] == f"{out}: ok"
    os.remove(os.path.join(out, "model.safetensors.index.json"))
    with open(os.path.join(out, "model-00001-of-00001.safetensors"), "r+b") as f:
        f.truncate(100)  # broken: still found without the library
    assert check([out]) == 1


def test_readme_holds_the_serving_table():
    readme = open(os.path.join(ROOT, "README.md")).read()
    assert "\n".join("  " + line for line in format_table().splitlines()) in readme


@pytest.mark.parametrize(
    "target, generation", [("hopper", "hopper"), ("H200", "hopper"), ("gb200", "blackwell"), ("L40S", "ada")]
)
def test_a_target_is_a_generation_or_a_gpu(target, generation):
    assert generation_of(target) == generation


def test_a_target_refuses_what_its_gpus_do_not_run_and_warns_of_weight_only_kernels():
    with pytest.raises(ConfigError, match="recipe nvfp4 .* does not run on Hopper .* give --recipe fp8"):
        check_target(["nvfp4"], "H200", "nvfp4")
    assert "weight-only" in check_target(["fp8_block"], "ampere", "fp8_block")
    assert check_target(["nvfp4", "fp8"], "B200", "nvfp4_experts_fp8_attention") is None
    with pytest.raises(ConfigError, match="--target 'V100': not a GPU generation"):
        generation_of("V100")


def test_the_card_names_the_hub_model_a_cache_snapshot_holds(tmp_path):
    snapshot = tmp_path / "hub" / "models--tiny-org--Tiny-MoE" / "snapshots" / "0123abcd"
    hf = make_tiny("qwen3_moe", str(snapshot))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False, reference=True)
    out = export_hf(ck, str(tmp_path / "out"), recipe="fp8_block", progress=False)
    card = open(os.path.join(out, "README.md")).read()
    assert card.startswith("---\nbase_model: tiny-org/Tiny-MoE\n")
    assert "No quality report" in card  # a data-free export


def test_every_weight_format_has_its_row_of_gpus_and_engines():
    """A format without a row would leave its card, --target and the plan without the GPUs it serves on."""
    assert {f for row in TABLE for f in row.formats} == set(WEIGHT_FORMATS)
