"""The smaller refusals: a recipe's duplicate key or contradictory group size, a budget the format
search cannot spend, an output found unwritable only after the work, a peer timeout that cannot
work: each refused up front, by name."""

import errno
import os

import pytest

from eprt.errors import ConfigError, EprtError
from eprt.hf.convert import convert_hf
from eprt.parallel import ParallelState
from eprt.parallel.liveness import PEER_TIMEOUT_ENV, peer_timeout_s
from eprt.quant.algorithms.search import auto_quantize_run
from eprt.quant.algorithms.search.budget import parse_budget
from eprt.quant.recipe import load_recipe
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny


@pytest.fixture(scope="module")
def ck(tmp_path_factory):
    root = tmp_path_factory.mktemp("smaller")
    return convert_hf(make_tiny("qwen3_moe", str(root / "hf")), str(root / "ck"), progress=False)


@pytest.mark.parametrize(
    "text, line, key",
    [
        ("quantize:\n- pattern: '*'\n  format: fp8\n  format: nvfp4\n", 4, "format"),
        ("quantize:\n- {pattern: '*', format: fp8, pattern: '*.mlp.*'}\n", 2, "pattern"),
        ("quantize:\n- {pattern: '*', format: fp8}\nquantize: []\n", 3, "quantize"),
    ],
)
def test_a_recipe_key_given_twice_is_refused(tmp_path, text, line, key):
    path = tmp_path / "r.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=f"{path}:{line}: the key '{key}' appears twice in one mapping"):
        load_recipe(str(path))


def test_a_group_size_contradicting_the_formats_own_is_refused(tmp_path):
    path = tmp_path / "r.yaml"
    path.write_text("quantize:\n- {pattern: '*', format: int4_g32, group_size: 128}\n")
    with pytest.raises(
        ConfigError, match="format 'int4_g32' is int4 in groups of 32, so the rule asks for two group sizes"
    ):
        load_recipe(str(path))
    for agreeing in (
        "{pattern: '*', format: int4_g32, group_size: 32}",
        "{pattern: '*', format: int4, group_size: 32}",
    ):
        path.write_text(f"quantize:\n- {agreeing}\n")
        assert load_recipe(str(path)).format_of("model.layers.0.mlp.down_proj") == "int4_g32"


@pytest.mark.parametrize("text", ["9" * 400, "17bits", "1e999"])
def test_a_budget_the_search_cannot_spend_is_refused(text):
    with pytest.raises(ConfigError, match="--auto-quantize"):
        parse_budget(text)


def never(*_args, **_kwargs):
    raise AssertionError("the search ran")


def test_an_infinite_budget_is_refused_before_the_search(ck, tmp_path, monkeypatch):
    monkeypatch.setattr(auto_quantize_run, "measure_format_errors", never)
    a = PTQArgs(ck, None, str(tmp_path / "q"), auto_quantize=float("inf"), eval_size=2, progress=False)
    with pytest.raises(EprtError, match="--auto-quantize infbits: give a budget of bits per parameter above 0"):
        run_ptq(ParallelState.single("cpu"), a)


def test_an_unwritable_output_is_found_before_the_search(ck, tmp_path, monkeypatch):
    monkeypatch.setattr(auto_quantize_run, "measure_format_errors", never)
    mkdir = os.mkdir

    def read_only(path, *args):
        if os.path.basename(path).startswith(".q.probe-"):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), path)
        return mkdir(path, *args)

    monkeypatch.setattr(os, "mkdir", read_only)
    out = tmp_path / "q"
    a = PTQArgs(ck, None, str(out), auto_quantize=4.8, eval_size=2, calib_size=4, seq_len=16, progress=False)
    with pytest.raises(EprtError, match=f"{out}: the file system is read-only writing the output {out}"):
        run_ptq(ParallelState.single("cpu"), a)
    assert sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("value", ["inf", "0.001", "nan", "-1", "1e9", "soon"])
def test_a_peer_timeout_that_cannot_work_is_refused_by_name(monkeypatch, value):
    monkeypatch.setenv(PEER_TIMEOUT_ENV, value)
    with pytest.raises(ConfigError, match=f"{PEER_TIMEOUT_ENV}='{value}' is not a number of seconds from 0.5 to 86400"):
        peer_timeout_s()


@pytest.mark.parametrize("value, seconds", [("0.5", 0.5), ("3", 3.0), ("86400", 86400.0)])
def test_a_peer_timeout_in_bounds_is_taken(monkeypatch, value, seconds):
    monkeypatch.setenv(PEER_TIMEOUT_ENV, value)
    assert peer_timeout_s() == seconds
