"""`eprt-quantize HF_DIR OUT`: one command from a Hugging Face model to a checked, carded export that
transformers runs; its cheap refusals come before any work, a run started again continues where
it stopped, and `--target` picks or refuses the recipe."""

import json
import logging
import os
import re
import subprocess
import sys

import pytest
import torch

from eprt.commands import quantize_run
from eprt.commands.ptq import ptq
from eprt.commands.quantize import CALIBRATION, RANKS, quantize
from eprt.errors import ConfigError, OutputExistsError
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.quant.formats import weight_format
from eprt.quant.run.args import PTQArgs
from eprt.testing.tiny import make_tiny
from tests.formats_helpers import assert_transformers_loads
from tests.hf_utils import read_hf_tensors

CALIB = ["--calib-size", "4", "--seq-len", "16", "--eval-size", "2"]
WIDE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32)  # INT4's dims
TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("quantize")
    hf = make_tiny("qwen3_moe", str(d / "hf"))
    with open(os.path.join(hf, "README.md"), "w") as f:
        f.write("# the source's own card\n")
    chats = d / "chats.jsonl"
    with open(chats, "w") as f:
        for i in range(8):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"question {i}"}]}) + "\n")
    (d / "template.jinja").write_text(TEMPLATE)
    return hf, str(chats), str(d / "template.jinja")


def test_one_command_makes_a_checked_carded_export_that_transformers_runs(source, tmp_path, capsys, caplog):
    hf, chats, template = source
    caplog.set_level(logging.INFO, logger="eprt")
    out = str(tmp_path / "out")
    args = [hf, out, "--recipe", "fp8", "--format", "compressed-tensors", "--calib", chats, *CALIB]
    assert quantize([*args, "--chat-template", template]) == 0
    assert sorted(os.listdir(out)) == [
        "README.md",
        "chat_template.jinja",  # the template calibration rendered with, for serving too
        "config.json",
        "eprt_quality.html",
        "eprt_quality.json",
        "generation_config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert not os.path.exists(f"{out}.work")  # the steps' outputs are gone once OUT is written
    assert open(os.path.join(out, "chat_template.jinja")).read() == TEMPLATE
    assert "<|user|>question 0" in caplog.text  # the first sample, as the template rendered it
    assert re.search(
        r"calibration data .*chats.jsonl: 7 documents \(1 cut short\), 96 tokens for 4 sequences", caplog.text
    )
    card = open(os.path.join(out, "README.md")).read()
    assert "recipe `fp8`" in card and "compressed-tensors layout" in card and "vllm serve $MODEL" in card
    assert check_export(out, hf) == []
    said = capsys.readouterr().out
    assert f"quantized model: {out} " in said and f"vllm serve {out} " in said and "Hopper (H100" in said

    tensors = read_hf_tensors(out)
    fp8 = weight_format("fp8")

    def eprt_value(module: str) -> torch.Tensor:
        leaves = {"weight": tensors[f"{module}.weight"], "weight_scale": tensors[f"{module}.weight_scale"]}
        return fp8.dequantize(leaves, torch.bfloat16)

    assert_transformers_loads(out, eprt_value)
    from transformers import AutoModelForCausalLM
    from transformers.utils.quantization_config import CompressedTensorsConfig

    ids = torch.randint(0, 500, (1, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model = AutoModelForCausalLM.from_pretrained(
            out, dtype=torch.bfloat16, quantization_config=CompressedTensorsConfig(dequantize=True)
        )
        quantized = model(ids).logits.float()
        unquantized = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)(ids).logits.float()
    assert (quantized.argmax(-1) == unquantized.argmax(-1)).float().mean() > 0.8


def test_a_target_picks_the_recipe_and_a_data_free_one_runs_without_data(tmp_path, capsys):
    hf = make_tiny("qwen3_moe", str(tmp_path / "hf"), **WIDE)
    out = str(tmp_path / "out")
    assert quantize([hf, out, "--target", "A100", "--quiet"]) == 0  # Ampere: int4, data-free
    card = open(os.path.join(out, "README.md")).read()
    assert "recipe `int4`" in card and "compressed-tensors layout" in card  # the one layout that holds INT4
    assert "No quality report" in card
    assert check_export(out, hf) == []
    assert "serves on: Ampere (A100" in capsys.readouterr().out


def test_a_run_started_again_continues_after_its_last_step(source, tmp_path, monkeypatch):
    hf, chats, _ = source
    straight = str(tmp_path / "straight")
    args = ["--recipe", "nvfp4", "--calib", chats, *CALIB, "--quiet"]
    assert quantize([hf, straight, *args]) == 0

    out = str(tmp_path / "out")

    def export_fails(*a, **kw):
        raise OSError(28, "No space left on device", out)

    with monkeypatch.context() as m:
        m.setattr(quantize_run, "export_hf", export_fails)
        with pytest.raises(OSError):
            quantize([hf, out, *args])
    assert sorted(os.listdir(f"{out}.work")) == ["calibrated", "checkpoint", "eprt-quantize.json"]
    with pytest.raises(ConfigError, match=r"holds a run with other settings \(recipe\)"):
        quantize([hf, out, "--recipe", "fp8", "--calib", chats, *CALIB])
    with monkeypatch.context() as m:  # calibrated already: not again
        m.setattr(quantize_run, "ptq", lambda argv: pytest.fail("calibrated again"))
        assert quantize([hf, out, *args]) == 0
    for f in os.listdir(straight):
        assert open(os.path.join(out, f), "rb").read() == open(os.path.join(straight, f), "rb").read(), f


@pytest.mark.parametrize(
    "args, refusal",
    [
        (["--recipe", "nvfp4", "--target", "H200"], "recipe nvfp4 .* does not run on Hopper GPUs"),
        (["--recipe", "nvfp4", "--calib", "missing.jsonl"], "missing.jsonl"),
        (["--recipe", "int3"], "--recipe 'int3': no such recipe"),
        (["--recipe", "nvfp4", "--chat-template", "none.jinja"], "--chat-template none.jinja: no such file"),
        ([], "give --recipe NAME"),
    ],
)
def test_cheap_refusals_come_before_any_work(source, tmp_path, args, refusal):
    hf, _, _ = source
    with pytest.raises(ConfigError, match=refusal):
        quantize([hf, str(tmp_path / "out"), *args])
    assert os.listdir(tmp_path) == []


def test_an_existing_output_is_refused_before_any_work(source, tmp_path):
    hf, _, _ = source
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "x").write_text("")
    with pytest.raises(OutputExistsError, match="pass --overwrite"):
        quantize([hf, str(tmp_path / "out"), "--recipe", "nvfp4"])
    assert sorted(os.listdir(tmp_path)) == ["out"]


def test_a_model_above_tiny_is_not_calibrated_on_the_built_in_text_unless_asked(source, tmp_path, monkeypatch):
    hf, _, _ = source
    monkeypatch.setattr(quantize_run, "TINY_PARAMETERS", 1000)  # the tiny model then counts as large
    with pytest.raises(ConfigError, match="built-in text .* --calib builtin to use it anyway"):
        quantize([hf, str(tmp_path / "out"), "--recipe", "nvfp4", *CALIB])
    assert not (tmp_path / "out").exists()
    assert quantize([hf, str(tmp_path / "out"), "--recipe", "nvfp4", "--calib", "builtin", *CALIB, "--quiet"]) == 0


def test_the_defaults_said_are_eprt_ptqs():
    defaults = {f.name: f.default for f in PTQArgs.__dataclass_fields__.values()}
    for flag, (_, text) in {**CALIBRATION, **RANKS}.items():
        said = text.rsplit("(default ", 1)[-1].rstrip(")")
        if said.isdigit():
            assert int(said) == defaults[flag[2:].replace("-", "_")], flag


@pytest.mark.parametrize("command", ["quantize", "ptq", "convert", "export", "check", "report", "make_tiny", "docs"])
def test_help_and_version_answer_without_torch(command):
    """What makes --help slow is importing torch: a command's parser imports none of it."""
    code = (
        f"import sys; sys.argv = ['eprt', '--help']\n"
        f"from eprt.commands.{command} import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ})
    assert r.returncode == 0, r.stderr
    assert "--version" in r.stdout and "Documentation: eprt-docs " in r.stdout and "docs/" not in r.stdout


def test_the_plan_says_which_gpus_serve_the_export(source, tmp_path, capsys):
    hf, _, _ = source
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False, reference=True)
    assert ptq([ck, "--dry-run", "--recipe", "nvfp4_experts_fp8_attention"]) == 0
    assert "its export serves on: Blackwell (B200" in capsys.readouterr().out


def test_a_data_free_recipe_streams_any_model_type_as_the_model_free_export_does(tmp_path):
    """A recipe that takes no statistic needs no model code: eprt-quantize streams the source (no
    convert, no work directory), for a model_type eprt does not model, byte for byte what
    `eprt-export HF_DIR OUT --recipe R` writes; a calibrated recipe on that model is refused by name."""
    from eprt.hf.streaming import stream_export
    from tests.test_model_free import make_olmoe

    hf = make_olmoe(str(tmp_path / "hf"))
    out = str(tmp_path / "out")
    assert quantize([hf, out, "--recipe", "fp8_block", "--base-model", "org/olmoe", "--quiet"]) == 0
    ref = stream_export(hf, str(tmp_path / "ref"), "fp8_block", fmt="modelopt", base_model="org/olmoe", progress=False)
    assert sorted(os.listdir(out)) == sorted(os.listdir(ref))
    for name in os.listdir(ref):
        with open(os.path.join(out, name), "rb") as a, open(os.path.join(ref, name), "rb") as b:
            assert a.read() == b.read(), name
    assert "base_model: org/olmoe" in open(os.path.join(out, "README.md")).read()
    assert not os.path.exists(out + ".work") and check_export(out, hf) == []
    with pytest.raises(ConfigError, match=r"model_type 'olmoe' is not supported"):
        quantize([hf, str(tmp_path / "q"), "--recipe", "nvfp4", "--calib", "builtin", "--quiet"])
    # a rotation takes no statistic either, but rewrites the model: converted, so refused for a model eprt does not model
    with pytest.raises(ConfigError, match=r"model_type 'olmoe' is not supported"):
        quantize([hf, str(tmp_path / "r"), "--recipe", "fp8_block", "--algorithm", "rotate", "--quiet"])
