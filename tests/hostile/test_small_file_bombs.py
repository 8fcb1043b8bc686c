"""Small inputs cannot cost big resources: every size read from a file is bounded before anything
is allocated by it, and a file broken in any way is one refusal naming the file and the field.

The memory tests run the command in a child process and compare the growth of its peak resident
set (VmHWM, which starts afresh at exec, unlike ru_maxrss, and which the child's own imports set
first) against a bound derived from the input.
"""

import json
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from eprt.data import calibration_samples
from eprt.errors import CheckpointError, ConfigError
from eprt.families import parse_hf_config
from eprt.hf.convert import convert_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.quant.recipe import load_recipe
from eprt.quant.run.memory_check import check_memory
from eprt.quant.run.memory_plan import RunShape
from eprt.quant.run.planner import Planner
from eprt.storage.checkpoint import MANIFEST, Checkpoint
from eprt.storage.safetensors_io import SafetensorsFile
from eprt.testing.tiny import TINY_DIR, make_tiny, tiny_config
from eprt.units import parse_size

MiB = 2**20


def peak_growth(code: str, timeout: int = 120) -> tuple[str, int]:
    """(what `code` printed, how far its peak resident set grew past the one before it ran), run
    in a child process that has imported eprt's commands first; its heap is capped at 4 GiB, so
    an unbounded allocation fails there instead of in the machine."""
    child = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_DATA, (4 << 30, 4 << 30))
        import eprt.hf.convert, eprt.quant.run.ptq, eprt.data
        from eprt.errors import EprtError
        from eprt.quant.run.process_memory import peak_rss
        before = peak_rss()
        try:
        {code}
        except EprtError as e:
            print("error:", e)
        print("grew", peak_rss() - before)
    """).format(code=textwrap.indent(textwrap.dedent(code), "    "))
    r = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out, grew = r.stdout.rsplit("grew ", 1)
    return out.strip(), int(grew)


# --- config.json: counts and reals ----------------------------------------------------------------


@pytest.mark.parametrize("field", ["num_hidden_layers", "num_experts"])
def test_a_1kb_config_with_a_billion_layers_or_experts_is_refused_before_building_names(tmp_path, field):
    src = make_tiny("qwen3_moe", str(tmp_path / "hf"))
    config = os.path.join(src, "config.json")
    json.dump({**json.load(open(config)), field: 10**9}, open(config, "w"))
    assert os.path.getsize(config) < 2048
    out, grew = peak_growth(f"eprt.hf.convert.convert_hf({src!r}, {str(tmp_path / 'ck')!r}, progress=False)")
    assert re.fullmatch(
        rf"error: {re.escape(config)}: field '{field}' is 1000000000; it must be from \d to \d+ .*", out
    ), out
    assert grew < 32 * MiB, grew  # the file is 1 KB; names for 10^9 layers would be tens of GB
    assert os.listdir(tmp_path) == ["hf"]


@pytest.mark.parametrize(
    "family,field,value",
    [
        ("qwen3_moe", "num_attention_heads", 0),
        ("qwen3_moe", "decoder_sparse_step", 0),
        ("qwen3_moe", "vocab_size", -1),
        ("qwen3_moe", "hidden_size", 10**400),
        ("deepseek_v3", "n_routed_experts", 10**6),
        ("deepseek_v3", "kv_lora_rank", 10**12),
        ("qwen3_next", "linear_num_key_heads", 0),
        ("qwen3_next", "full_attention_interval", 0),
        ("kimi_linear", "num_hidden_layers", 5 * 10**6),
        ("glm4_moe", "num_key_value_heads", 0),
    ],
)
def test_a_count_outside_what_any_model_holds_is_refused_naming_the_field(family, field, value):
    with pytest.raises(ConfigError, match=rf"^config\.json: field '{field}' is .*; it must be from \d to \d+"):
        parse_hf_config(tiny_config(family, **{field: value}), "config.json")


@pytest.mark.parametrize(
    "family,field,value",
    [
        ("qwen3_moe", "rms_norm_eps", float("nan")),
        ("qwen3_moe", "rms_norm_eps", 0.0),
        ("qwen3_moe", "rope_theta", float("inf")),
        ("deepseek_v3", "routed_scaling_factor", float("nan")),
        ("qwen3_next", "partial_rotary_factor", float("nan")),
    ],
)
def test_a_real_that_is_not_finite_or_out_of_range_is_refused_naming_the_field(family, field, value):
    with pytest.raises(ConfigError, match=rf"^config\.json: field '{field}' is {value!r}; it must be a finite number"):
        parse_hf_config(tiny_config(family, **{field: value}), "config.json")


def test_layers_times_experts_is_bounded_even_when_each_is_plausible():
    hf = tiny_config("qwen3_moe", num_hidden_layers=4000, num_experts=4000)  # each far beyond any model, but sane
    with pytest.raises(ConfigError, match=r"^config\.json: field 'num_experts' is 4000 in each of up to 4000 layers"):
        parse_hf_config(hf, "config.json")


@pytest.mark.parametrize(
    "field,value", [("mlp_only_layers", [10**9]), ("mlp_only_layers", ["a"]), ("mlp_only_layers", list(range(10**5)))]
)
def test_a_list_of_layers_is_bounded_and_typed(field, value):
    with pytest.raises(ConfigError, match=rf"^config\.json: field '{field}'"):
        parse_hf_config(tiny_config("qwen3_moe", **{field: value}), "config.json")


def test_real_configs_still_read():
    for family in ("qwen3_moe", "deepseek_v3", "kimi_linear", "kimi_k3", "qwen3_next", "glm4_moe"):
        parse_hf_config(tiny_config(family), "config.json")


# --- the manifest and safetensors headers ---------------------------------------------------------


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("bombs")
    return convert_hf(make_tiny("qwen3_moe", str(d / "hf")), str(d / "ck"), progress=False)


def crafted(ckpt: str, tmp_path, edit) -> str:
    """A copy of the manifest of `ckpt`, edited, beside links to its files."""
    out = tmp_path / "ck"
    out.mkdir()
    for name in os.listdir(ckpt):
        if name != MANIFEST:
            os.symlink(os.path.join(ckpt, name), out / name)
    m = json.load(open(os.path.join(ckpt, MANIFEST)))
    (out / MANIFEST).write_bytes(edit(m))
    return str(out)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda m: json.dumps(m).encode().replace(b'"family"', b'"fam\xe9ly"'), r"not UTF-8 text \(byte \d+\)"),
        (lambda m: b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (
            lambda m: json.dumps({**m, "config": {**m["config"], "num_layers": 10**9}}).encode(),
            r"config\.num_layers: is 1000000000, outside \[0, \d+\]",
        ),
        (
            lambda m: json.dumps({**m, "config": {**m["config"], "rms_norm_eps": float("nan")}}).encode(),
            r"config\.rms_norm_eps: is nan, not a finite number",
        ),
        (lambda m: json.dumps([m]).encode(), "holds a JSON list, not an object"),
    ],
)
def test_a_crafted_manifest_is_one_refusal_naming_it(ckpt, tmp_path, edit, message):
    path = crafted(ckpt, tmp_path, edit)
    with pytest.raises(CheckpointError, match=rf"^{re.escape(os.path.join(path, MANIFEST))}: .*{message}"):
        Checkpoint(path)


@pytest.mark.parametrize(
    "header", [b"[" * 50_000 + b"]" * 50_000, b'{"x": {"dtype": "I64", "shape": [-2, -4], "data_offsets": [0, 64]}}']
)
def test_a_crafted_safetensors_header_is_refused_naming_the_file(tmp_path, header):
    path = tmp_path / "x.safetensors"
    path.write_bytes(len(header).to_bytes(8, "little") + header + bytes(64))
    with pytest.raises(CheckpointError, match=rf"^{re.escape(str(path))}: "):
        SafetensorsFile(str(path))


# --- recipes ----------------------------------------------------------------------------------------

# nine strings, then eight levels of nine aliases of the level below: 9^9 strings once expanded
ALIAS_BOMB = (
    "a: &a ["
    + ", ".join(['"x"'] * 9)
    + "]\n"
    + "".join(f"{name}: &{name} [{', '.join([f'*{below}'] * 9)}]\n" for below, name in zip("abcdefg", "bcdefgh"))
)


def test_a_recipe_that_is_a_yaml_alias_bomb_is_refused_at_once(tmp_path):
    recipe = tmp_path / "bomb.yaml"
    recipe.write_text(ALIAS_BOMB + "name: *h\nquantize: [{pattern: '*', format: fp8}]\n")
    assert recipe.stat().st_size < 512
    out, grew = peak_growth(f"eprt.quant.recipe.load_recipe({str(recipe)!r})", timeout=60)
    assert re.fullmatch(
        rf"error: {re.escape(str(recipe))}:\d+: the YAML alias \*\w is not allowed in a recipe.*", out
    ), out
    assert grew < 16 * MiB, grew


def test_a_recipe_nested_thousands_deep_is_refused_naming_it(tmp_path):
    recipe = tmp_path / "deep.yaml"
    recipe.write_text("quantize: " + "[" * 20_000 + "]" * 20_000 + "\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(recipe))}: nested too deeply"):
        load_recipe(str(recipe))


def test_a_recipe_name_must_be_text(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("name: [1, 2]\nquantize: [{pattern: '*', format: fp8}]\n")
    with pytest.raises(ConfigError, match=r"name \[1, 2\] is not a string"):
        load_recipe(str(recipe))


# --- calibration data -------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_one_8mib_document_for_64_tokens_is_tokenized_only_as_far_as_needed(tmp_path, suffix):
    text = "The river ran low in late summer, and the tokens travelled to their experts. " * 110_000
    path = tmp_path / f"big{suffix}"
    path.write_text(json.dumps({"text": text}) + "\n" if suffix == ".jsonl" else text)
    assert path.stat().st_size >= 8 * MiB
    out, grew = peak_growth(f"""
        s = eprt.data.calibration_samples({str(path)!r}, {TINY_DIR!r}, num_samples=8, seq_len=8, vocab_size=512)
        print(s.shape[0] * s.shape[1])
    """)
    assert out == "64"
    # the line itself, read and decoded (a few copies of 8 MiB); tokenizing all of it took 1.5 GB
    assert grew < 6 * path.stat().st_size, grew


def test_the_first_tokens_of_a_long_document_are_those_of_the_whole(tmp_path):
    from tokenizers import Tokenizer

    text = " ".join(f"word{i % 977}x{i % 13}" for i in range(40_000))
    (tmp_path / "long.txt").write_text(text)
    whole = Tokenizer.from_file(os.path.join(TINY_DIR, "tokenizer.json")).encode(text, add_special_tokens=False).ids
    s = calibration_samples(str(tmp_path / "long.txt"), TINY_DIR, num_samples=4, seq_len=100, vocab_size=512)
    assert s.reshape(-1).tolist() == whole[:400]


def test_a_192_byte_npy_declaring_1e11_ids_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "ids.npy"
    header = np.lib.format.header_data_from_array_1_0(np.zeros(1, np.int64))
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, {**header, "shape": (10**11,)})
        f.write(np.arange(8, dtype=np.int64).tobytes())
    assert path.stat().st_size <= 192
    with pytest.raises(
        ConfigError, match=rf"^{re.escape(str(path))}: declares 100000000000 token ids .* holds 64 bytes"
    ):
        calibration_samples(str(path), TINY_DIR, num_samples=2, seq_len=8, vocab_size=512)


def test_token_ids_are_read_only_as_far_as_needed(tmp_path):
    from safetensors.numpy import save_file

    ids = np.arange(128 * MiB // 8, dtype=np.int64) % 500
    np.save(tmp_path / "ids.npy", ids.reshape(-1, 1024))
    save_file({"input_ids": ids.reshape(-1, 1024)}, str(tmp_path / "ids.safetensors"))
    for name in ("ids.npy", "ids.safetensors"):
        out, grew = peak_growth(f"""
            s = eprt.data.calibration_samples({str(tmp_path / name)!r}, {TINY_DIR!r}, num_samples=4, seq_len=16,
                                              vocab_size=512)
            print(s.reshape(-1).tolist() == list(range(64)))
        """)
        assert out == "True", out
        assert grew < 16 * MiB, (name, grew)  # the file is 128 MiB


def test_a_jsonl_line_nested_thousands_deep_names_the_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "a"}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(path))}:2: nested too deeply"):
        calibration_samples(str(path), TINY_DIR, num_samples=2, seq_len=8, vocab_size=512)


def test_a_truncated_tokenizer_json_is_refused_naming_it(tmp_path):
    data = open(os.path.join(TINY_DIR, "tokenizer.json"), "rb").read()
    (tmp_path / "tokenizer.json").write_bytes(data[: len(data) // 2])
    (tmp_path / "c.txt").write_text("some text to calibrate on")
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(tmp_path / 'tokenizer.json'))}: not a tokenizer"):
        calibration_samples(str(tmp_path / "c.txt"), str(tmp_path), num_samples=2, seq_len=8, vocab_size=512)


# --- the memory plan ----------------------------------------------------------------------------------


def test_a_seq_len_too_long_for_memory_is_refused_naming_the_longest_that_fits(ckpt):
    seq_len, limit = 5 * 10**7, parse_size("512MiB")
    with Checkpoint(ckpt) as ck:
        planner = Planner.of(ResolvedCheckpoint.of(ck, torch.float32), torch.device("cpu"))

        def plan(T):
            return planner.plan(
                RunShape(rank=0, world=1, ep=1, num_sequences=64, seq_len=T, step_sequences=1, group_tokens=512),
                baseline=0,
            )

        with pytest.raises(ConfigError) as e:
            check_memory(
                planner,
                plan(seq_len),
                limit,
                RunShape(rank=0, world=1, ep=1, num_sequences=64, seq_len=seq_len, step_sequences=1, group_tokens=512),
                num_experts=8,
            )
    m = re.search(r"over --max-memory 512\.00 MiB: use --seq-len (\d+)$", str(e.value))
    assert m, str(e.value)
    fits = int(m.group(1))
    assert plan(fits).peak <= limit < plan(fits + 1).peak


def test_the_ptq_run_refuses_a_seq_len_too_long_before_reading_any_data(ckpt, tmp_path):
    """The run plans from the sizes alone: 64 sequences of 5e7 tokens are refused before the tokens
    (25 GB of ids) or anything of their size is built, and the refusal names --seq-len."""
    out, grew = peak_growth(f"""
        from eprt.parallel import ParallelState
        from eprt.quant.run.ptq import PTQArgs, run_ptq
        run_ptq(ParallelState.single("cpu"), PTQArgs({ckpt!r}, "nvfp4", {str(tmp_path / "q")!r}, seq_len=5 * 10**7,
                                                    max_memory=512 * 2**20, progress=False))
    """)
    assert re.search(r"over --max-memory 512\.00 MiB: use --seq-len \d+$", out), out
    assert grew < 64 * MiB, grew
    assert not (tmp_path / "q").exists()
