"""Hostile or careless input gets one clear refusal naming the culprit, before any output appears.

Each test crafts the input a user could hand eprt (broken weights, a config.json with a string
for a number, an empty or random calibration file, a misspelt recipe, a full disk, a model the
recipe cannot quantize) and checks the refusal: an EprtError (one line from the tools) naming the
tensor, field, file, path or pattern, and no output left behind.
"""

import errno
import json
import logging
import os
import random
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from eprt.cli import run
from eprt.data import calibration_samples
from eprt.errors import ConfigError, EprtError
from eprt.families import parse_hf_config, read_hf_config
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState, fail_together
from eprt.quant.recipe import parse_recipe
from eprt.quant.run import ptq
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage import safetensors_io
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import TINY_DIR, make_tiny, tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MAX_POSITIONS = 16  # the tiny Qwen3-MoE's, small so that a --seq-len beyond it is cheap


def edit_weights(hf_dir: str, fn) -> None:
    path = os.path.join(hf_dir, "model.safetensors")
    tensors = load_file(path)
    fn(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def calibrate(ck: str, out: str, recipe: str = "nvfp4", **kw) -> dict:
    kw = {"calib_size": 2, "seq_len": 8, "progress": False, **kw}
    return run_ptq(ParallelState.single(), PTQArgs(ck, recipe, out, **kw))


@pytest.fixture(scope="module")
def qwen_hf(tmp_path_factory):
    return make_tiny("qwen3_moe", str(tmp_path_factory.mktemp("qwen") / "hf"), max_position_embeddings=MAX_POSITIONS)


@pytest.fixture(scope="module")
def qwen(qwen_hf, tmp_path_factory):
    return convert_hf(qwen_hf, str(tmp_path_factory.mktemp("qwen_ck") / "ck"), progress=False)


@pytest.fixture(scope="module")
def deepseek_24(tmp_path_factory):
    """DeepSeek-V3 whose routed and shared experts are 24 wide: NVFP4 cannot block their down_proj."""
    d = tmp_path_factory.mktemp("ds24")
    return convert_hf(make_tiny("deepseek_v3", str(d / "hf"), moe_intermediate_size=24), str(d / "ck"), progress=False)


# --- convert: weights that are not weights ----------------------------------------------------------


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_convert_refuses_non_finite_weights_naming_the_tensor(tmp_path, value, dtype):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"), dtype=dtype)

    def poison(t):
        t["model.layers.2.mlp.experts.5.down_proj.weight"][3, 7] = value

    edit_weights(src, poison)
    with pytest.raises(
        EprtError,
        match=r"model\.safetensors: tensor 'model\.layers\.2\.mlp\.experts\.5\.down_proj"
        r"\.weight' holds NaN or infinite values",
    ):
        convert_hf(src, str(tmp_path / "ck"), progress=False)
    assert os.listdir(tmp_path) == ["hf"]  # no output, no temp directory


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_the_largest_and_smallest_finite_weights_convert(tmp_path, dtype):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"), dtype=dtype)
    name = "model.layers.2.mlp.experts.5.down_proj.weight"

    def extremes(t):
        info = torch.finfo(t[name].dtype)
        t[name][0, :4] = torch.tensor([info.max, -info.max, info.tiny, info.smallest_normal / 4])

    edit_weights(src, extremes)
    convert_hf(src, str(tmp_path / "ck"), progress=False)
    with Checkpoint(str(tmp_path / "ck")) as ck:
        assert torch.equal(
            ck.read("model.layers.2.mlp.experts.w2", rows=(5, 6))[0],
            load_file(os.path.join(src, "model.safetensors"))[name],
        )


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_convert_refuses_integer_or_bool_weights_naming_the_tensor(tmp_path, dtype):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"))
    edit_weights(
        src,
        lambda t: t.__setitem__(
            "model.layers.0.self_attn.k_proj.weight",
            torch.ones(t["model.layers.0.self_attn.k_proj.weight"].shape, dtype=dtype),
        ),
    )
    with pytest.raises(
        EprtError,
        match=rf"tensor 'model\.layers\.0\.self_attn\.k_proj\.weight' is {dtype}, but it "
        "is a weight of the model",
    ):
        convert_hf(src, str(tmp_path / "ck"), progress=False)
    assert os.listdir(tmp_path) == ["hf"]


# --- config.json ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "family,field,experts",
    [
        ("qwen3_moe", "num_experts_per_tok", 8),
        ("deepseek_v3", "num_experts_per_tok", 8),
        ("kimi_linear", "num_experts_per_token", 8),
    ],
)
@pytest.mark.parametrize("top_k", [0, 9])
def test_experts_per_token_outside_one_to_the_expert_count(family, field, experts, top_k):
    with pytest.raises(
        ConfigError,
        match=rf"field '{field}' is {top_k}; each token goes to 1 to {experts} routed "
        "experts",
    ):
        parse_hf_config(tiny_config(family, **{field: top_k}), "config.json")


@pytest.mark.parametrize(
    "field,value,kind",
    [
        ("hidden_size", "64", "an integer"),
        ("num_hidden_layers", True, "an integer"),
        ("num_experts", 7.5, "an integer"),
        ("rms_norm_eps", "1e-6", "a number"),
    ],
)
def test_a_wrong_type_in_config_json_names_the_field_and_the_type(tmp_path, field, value, kind):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"))
    cfg = json.load(open(os.path.join(src, "config.json")))
    json.dump({**cfg, field: value}, open(os.path.join(src, "config.json"), "w"))
    with pytest.raises(ConfigError, match=rf"config\.json: field '{field}' is {value!r} .* it must be {kind}"):
        convert_hf(src, str(tmp_path / "ck"), progress=False)
    assert os.listdir(tmp_path) == ["hf"]


def test_a_wrong_type_inside_a_nested_config_names_the_field_and_where_it_is():
    hf = tiny_config("kimi_k3")
    hf["text_config"]["linear_attn_config"]["num_heads"] = "4"
    with pytest.raises(
        ConfigError,
        match=r"config\.json \(text_config\) \(linear_attn_config\): field 'num_heads' "
        r"is '4' \(str\); it must be an integer",
    ):
        parse_hf_config(hf, "config.json")


@pytest.mark.parametrize(
    "rope_scaling,message",
    [
        (
            {"rope_type": "yarn", "factor": "4", "original_max_position_embeddings": 64},
            r"\(rope parameters\): field 'factor' is '4' \(str\); it must be a number",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "beta_fast": [32], "original_max_position_embeddings": 64},
            r"\(rope parameters\): field 'beta_fast' is \[32\] \(list\); it must be a number",
        ),
        (
            {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": "64"},
            r"\(rope parameters\): field 'original_max_position_embeddings' is '64' \(str\); it must be an integer",
        ),
        ("yarn", r"config\.json: field 'rope_scaling' is 'yarn' \(str\); it must be a JSON object"),
    ],
)
def test_a_wrong_type_in_the_rope_parameters_names_the_parameter(rope_scaling, message):
    with pytest.raises(ConfigError, match=message):
        parse_hf_config(tiny_config("deepseek_v3", rope_scaling=rope_scaling), "config.json")


@pytest.mark.parametrize(
    "content,message",
    [
        (b'{"model_type": "qwen3_moe", "name": "caf\xe9"}', r"config\.json: not UTF-8 text \(byte \d+\)"),
        (b'{"model_type": "qwen3_moe",', r"config\.json: not valid JSON"),
        (b'["qwen3_moe"]', r"config\.json: holds a JSON list, not an object; a config\.json is a UTF-8 JSON object"),
        (b'{"model_type": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", r"config\.json: nested too deeply to be read"),
    ],
)
def test_a_config_json_that_is_not_a_json_object_of_text(tmp_path, content, message):
    (tmp_path / "config.json").write_bytes(content)
    with pytest.raises(ConfigError, match=message):
        read_hf_config(str(tmp_path))


# --- calibration data --------------------------------------------------------------------------------


def test_an_empty_calibration_text_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_text("")
    with pytest.raises(ConfigError, match=rf"{path}: holds no text to calibrate on"):
        calibration_samples(str(path), TINY_DIR, num_samples=2, seq_len=8, vocab_size=512)


@pytest.mark.parametrize(
    "suffix,expected",
    [
        (".npy", "not a NumPy .npy array of token ids"),
        (".safetensors", "not a safetensors file of token ids"),
        (".txt", "not UTF-8 text"),
        (".jsonl", "not UTF-8 text"),
    ],
)
def test_random_bytes_as_calibration_data_name_the_file_and_what_was_expected(tmp_path, suffix, expected):
    path = tmp_path / f"data{suffix}"
    path.write_bytes(random.Random(0).randbytes(4096))
    with pytest.raises(ConfigError, match=rf"{path}: {expected}"):
        calibration_samples(str(path), TINY_DIR, num_samples=2, seq_len=8, vocab_size=512)


def test_a_damaged_generation_config_is_named_when_text_is_tokenized(tmp_path):
    shutil.copy(os.path.join(TINY_DIR, "tokenizer.json"), tmp_path)
    (tmp_path / "generation_config.json").write_bytes(b'{"eos_token_id": 0,')
    with pytest.raises(ConfigError, match=rf"{tmp_path}/generation_config\.json: not valid JSON"):
        calibration_samples(None, str(tmp_path), num_samples=2, seq_len=8, vocab_size=512)


def test_a_seq_len_beyond_the_model_positions_is_said_once(qwen, tmp_path):
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("eprt").addHandler(handler)
    try:
        calibrate(qwen, str(tmp_path / "q"), "fp8", calib_size=1, seq_len=2 * MAX_POSITIONS)
    finally:
        logging.getLogger("eprt").removeHandler(handler)
    said = [r.getMessage() for r in records if "max_position_embeddings" in r.getMessage()]
    assert said == [
        f"--seq-len {2 * MAX_POSITIONS} is beyond the model's max_position_embeddings {MAX_POSITIONS}; "
        "the calibration sees positions the model was not trained for: lower --seq-len"
    ]


# --- recipes -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "recipe,message",
    [
        (
            {"name": "r", "quantize": [{"pattern": "*", "format": "nvfp4"}], "kv-cache": "fp8"},
            "r.yaml: unknown key 'kv-cache'; the valid keys are name, quantize, kv_cache, mtp, scale_headroom, act_headroom, ignore, experts_storage",
        ),
        (
            {"quantise": [{"pattern": "*", "format": "nvfp4"}]},
            "r.yaml: unknown key 'quantise'; the valid keys are name, quantize, kv_cache, mtp, scale_headroom, act_headroom, ignore, experts_storage",
        ),
        (
            {"quantize": [{"pattern": "*", "format": "nvfp4", "kv_cache": "fp8"}]},
            "r.yaml: quantize[0]: unknown key 'kv_cache'; the valid keys are pattern, format, algorithm, group_size, grid",
        ),
    ],
)
def test_a_recipe_with_an_unknown_key_names_it_and_the_valid_ones(recipe, message):
    with pytest.raises(ConfigError) as e:
        parse_recipe(recipe, "r.yaml")
    assert str(e.value) == message


def test_a_recipe_that_quantizes_nothing_is_refused_with_the_names_it_could_match(qwen, tmp_path, monkeypatch):
    recipe = tmp_path / "typo.yaml"
    recipe.write_text(
        'name: typo\nquantize:\n  - {pattern: "*.mlp.expert", format: nvfp4}\n  - {pattern: "*", format: none}\n'
    )
    monkeypatch.setattr(ptq, "load_parallel", lambda *a, **k: pytest.fail("a weight was loaded before the refusal"))
    with pytest.raises(
        EprtError,
        match=r"recipe 'typo' quantizes no module of .*: pattern '\*\.mlp\.expert' "
        r"matches no module \(closest: model\.layers\.\d\.mlp\.experts",
    ):
        calibrate(qwen, str(tmp_path / "q"), str(recipe))
    assert not (tmp_path / "q").exists()


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_a_recipe_that_splits_a_fused_module_is_refused_at_the_start(qwen, tmp_path, monkeypatch, fmt):
    """vLLM loads q/k/v as one qkv_proj: quantizing q_proj alone would fail export's check at the end."""
    recipe = tmp_path / "q_only.yaml"
    recipe.write_text(
        f'name: q_only\nquantize:\n  - {{pattern: "*.q_proj", format: {fmt}}}\n  - {{pattern: "*", format: none}}\n'
    )
    monkeypatch.setattr(ptq, "load_parallel", lambda *a, **k: pytest.fail("a weight was loaded before the refusal"))
    with pytest.raises(
        EprtError,
        match=r"recipe 'q_only' quantizes model\.layers\.0\.self_attn\.q_proj but not "
        r"model\.layers\.0\.self_attn\.k_proj, model\.layers\.0\.self_attn\.v_proj; "
        r"the engines load k_proj/q_proj/v_proj as one fused module",
    ):
        calibrate(qwen, str(tmp_path / "q"), str(recipe))
    assert not (tmp_path / "q").exists()


# --- refused at the start, not at the end ----------------------------------------------------------

NVFP4_24 = (
    r"model\.layers\.1\.mlp\.experts\.w2: input dim 24 is not a multiple of 16; NVFP4 cannot quantize it "
    r"\(and {more}\): exclude it in recipe '{recipe}'"
)
# every weight 24 wide the recipe quantizes, after the first
ALL_24 = (
    r"3 more: model\.layers\.1\.mlp\.shared_experts\.down_proj, model\.layers\.2\.mlp\.experts\.w2, "
    r"model\.layers\.2\.mlp\.shared_experts\.down_proj"
)
EXPERTS_24 = r"1 more: model\.layers\.2\.mlp\.experts\.w2"


@pytest.mark.parametrize("recipe,more", [("nvfp4", ALL_24), ("nvfp4_experts_only", EXPERTS_24)])
def test_ptq_refuses_what_nvfp4_export_would_refuse_before_loading_a_weight(
    deepseek_24, tmp_path, monkeypatch, recipe, more
):
    monkeypatch.setattr(ptq, "load_parallel", lambda *a, **k: pytest.fail("a weight was loaded before the refusal"))
    with pytest.raises(EprtError, match=NVFP4_24.format(recipe=recipe, more=more)):
        calibrate(deepseek_24, str(tmp_path / "q"), recipe)
    assert not (tmp_path / "q").exists()


def test_the_dry_run_refuses_it_too_in_one_line(deepseek_24):
    r = subprocess.run(
        [sys.executable, "tools/ptq.py", deepseek_24, "--dry-run", "--recipe", "nvfp4"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {deepseek_24}: model.layers.1.mlp.experts.w2: input dim 24")


def test_export_refuses_by_the_same_rule(deepseek_24, tmp_path):
    """A calibrated checkpoint whose recipe was changed to NVFP4 afterwards: export refuses before writing,
    with the words PTQ uses."""
    q = str(tmp_path / "q")
    calibrate(deepseek_24, q, "fp8")  # FP8 quantizes any shape
    path = os.path.join(q, "eprt.json")
    m = json.load(open(path))
    m["quantization"]["recipe"]["quantize"] = [{"pattern": "*", "format": "nvfp4"}]
    m["quantization"]["recipe"]["name"] = "nvfp4"
    json.dump(m, open(path, "w"))
    with pytest.raises(EprtError, match=NVFP4_24.format(recipe="nvfp4", more=ALL_24)):
        export_hf(q, str(tmp_path / "out"), progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "eval_size, message",
    [
        (0, r"model\.layers\.2\.self_attn\.q_proj \(input\): calibration on rank 0 recorded a non-finite amax"),
        # the quality report quantizes layer 1 as soon as it is calibrated: its weight is named first
        (2, r"model\.layers\.1\.mlp\.down_proj: weight scale: amax is inf.*check the checkpoint's weights"),
    ],
)
def test_a_non_finite_amax_is_refused_at_ptq_naming_module_and_rank(qwen_hf, tmp_path, eval_size, message):
    """Weights that turn to infinity after convert checked them: the calibration is refused, not published."""
    ck = convert_hf(qwen_hf, str(tmp_path / "ck"), progress=False)
    c = Checkpoint(ck)
    f, offset, n = c.byte_range("model.layers.1.mlp.down_proj.weight")  # the dense layer before layer 2
    path = f.path
    c.close()
    with open(path, "r+b") as out:
        out.seek(offset)
        out.write(torch.full((n // 2,), float("inf"), dtype=torch.bfloat16).view(torch.uint8).numpy().tobytes())
    with pytest.raises(EprtError, match=message):
        calibrate(ck, str(tmp_path / "q"), eval_size=eval_size)
    assert not (tmp_path / "q").exists()


# --- a file system that refuses the write -----------------------------------------------------------


def refusal_of(main, capsys) -> list[str]:
    """The lines a tool prints when `main` fails; the tool must exit 2 (a refusal, not a crash)."""
    with pytest.raises(SystemExit) as e:
        run(main)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


def test_a_full_disk_during_convert_names_the_file(qwen_hf, tmp_path, monkeypatch, capsys):
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "sendfile", full)
    out = tmp_path / "ck"
    lines = refusal_of(lambda: convert_hf(qwen_hf, str(out), progress=False), capsys)
    assert (
        len(lines) == 1
        and lines[0].startswith(f"error: {tmp_path}/.ck.partial-")
        and "safetensors: the disk is full: free space or write the output elsewhere" in lines[0]
    ), lines
    assert os.listdir(tmp_path) == []


def test_a_full_disk_found_while_syncing_behind_names_the_file(qwen_hf, tmp_path, monkeypatch, capsys):
    """The writer has the disk write what it wrote while it goes on (safetensors_io.SYNC_BEHIND_BYTES):
    a disk that refuses then is reported as any refused write."""

    def full(fd):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(safetensors_io, "SYNC_BEHIND_BYTES", 4096)
    monkeypatch.setattr(os, "fdatasync", full)
    out = tmp_path / "ck"
    lines = refusal_of(lambda: convert_hf(qwen_hf, str(out), progress=False), capsys)
    assert (
        len(lines) == 1
        and lines[0].startswith(f"error: {tmp_path}/.ck.partial-")
        and "safetensors: the disk is full: free space or write the output elsewhere" in lines[0]
    ), lines
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "code,way_out",
    [
        (errno.EROFS, "the file system is read-only: write the output elsewhere"),
        (errno.EDQUOT, "the disk quota is exceeded: free space or write the output elsewhere"),
        (errno.EACCES, "permission denied: write the output where you may write, or fix its permissions"),
    ],
)
def test_a_refused_write_in_a_guarded_step_is_one_line_naming_the_path(capsys, code, way_out):
    path = "/data/out/.q.partial/calibration.safetensors"

    def main():
        with fail_together(ParallelState.single(), "writing the output"):
            raise OSError(code, os.strerror(code), path)

    assert refusal_of(main, capsys) == [f"error: {path}: {way_out} ({os.strerror(code)})"]


def test_a_genuine_bug_keeps_its_traceback():
    def main():
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), "/nowhere")

    with pytest.raises(FileNotFoundError):
        run(main)
