"""`--kv-cache nvfp4` needs cached heads its blocks of 16 fill: refused from the config, before any data
is read or layer run, in the calibrated run, the format search and the dry run, naming the setting,
the model's head widths and the way out; the widths read are those the model's attention caches."""

import contextlib
import logging
import os
import re
import sys

import pytest
import torch

from eprt.commands import ptq as command
from eprt.errors import ConfigError, EprtError
from eprt.families import model_class, parse_hf_config
from eprt.hf.convert import convert_hf
from eprt.models.taps import KVTaps, tapped
from eprt.parallel import ParallelState
from eprt.quant.formats.kv import KV_CACHE_FORMATS
from eprt.quant.run import data as run_data
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.run.setup import check_kv_cache
from eprt.testing.tiny import families, make_tiny, tiny_config

NVFP4_BLOCK = KV_CACHE_FORMATS["nvfp4"].block


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    """A tiny DeepSeek-V3 checkpoint, whose MLA keys (plain and rope dims together) blocks of 16 do not fill."""
    hf = tiny_config("deepseek_v3")
    keys, values = hf["qk_nope_head_dim"] + hf["qk_rope_head_dim"], hf["v_head_dim"]
    assert keys % NVFP4_BLOCK and not values % NVFP4_BLOCK  # the case this file is about
    d = tmp_path_factory.mktemp("kv_heads")
    return convert_hf(make_tiny("deepseek_v3", str(d / "hf")), str(d / "ck"), progress=False), keys


@pytest.fixture
def no_data(monkeypatch):
    monkeypatch.setattr(run_data, "read_calibration", lambda *a, **k: pytest.fail("data was read before the refusal"))


def refusal(ck: str, keys: int, setting: str) -> str:
    """The whole refusal; a run's guard names its step before it (eprt.parallel.guard)."""
    return re.escape(
        f"{setting}: NVFP4 caches keys and values in blocks of {NVFP4_BLOCK} along the head dim, and {ck} "
        f"(deepseek_v3) caches key heads {keys} wide: calibrate with --kv-cache fp8 (one scale per tensor, any head width)"
    )


def test_the_widths_checked_are_those_every_familys_attention_caches():
    """The check reads the config; the oracle is what each family's attention hands its KV taps."""
    for family in families():
        config = parse_hf_config(tiny_config(family))
        if config.own is not None and not config.own.kv_cache_calibrated():
            continue  # no KV-cache taps: test_a_family_whose_cache_eprt_does_not_calibrate_says_so
        torch.manual_seed(0)
        model = model_class(config)(config)
        for p in model.parameters():
            p.data.normal_(0, 0.02)
        seen = set()
        attentions = [m for m in model.modules() if isinstance(getattr(m, "taps", None), KVTaps)]
        with contextlib.ExitStack() as taps, torch.inference_mode():
            for attn in attentions:
                taps.enter_context(tapped(attn, observe=lambda k, v: seen.add((k.shape[-1], v.shape[-1]))))
            model(torch.tensor([[1, 2, 3, 4]]))
        assert attentions and seen == {config.kv_head_dims}, family


def test_heads_the_blocks_fill_pass_and_fp8_takes_any_width():
    for family in families():
        config = parse_hf_config(tiny_config(family))
        check_kv_cache("fp8", config, family)
        if not any(w % NVFP4_BLOCK for w in config.kv_head_dims):
            check_kv_cache("nvfp4", config, family)
        else:
            with pytest.raises(ConfigError, match="--kv-cache nvfp4: NVFP4 caches keys and values in blocks of"):
                check_kv_cache("nvfp4", config, family)


@pytest.mark.parametrize("given", ["flag", "recipe"])
def test_the_calibrated_run_refuses_before_reading_data(deepseek, tmp_path, no_data, given):
    ck, keys = deepseek
    if given == "flag":
        recipe, kv, setting = "fp8", "nvfp4", "--kv-cache nvfp4"
    else:
        recipe, kv, setting = str(tmp_path / "r.yaml"), None, "recipe 'kv4''s kv_cache: nvfp4"
        (tmp_path / "r.yaml").write_text('name: kv4\nquantize:\n  - {pattern: "*", format: fp8}\nkv_cache: nvfp4\n')
    out = str(tmp_path / "q")
    with pytest.raises(EprtError, match=refusal(ck, keys, setting) + "$"):
        run_ptq(ParallelState.single(), PTQArgs(ck, recipe, out, kv_cache=kv, progress=False))
    assert not os.path.exists(out)


def test_the_format_search_refuses_before_reading_data(deepseek, tmp_path, no_data):
    ck, keys = deepseek
    out = str(tmp_path / "q")
    with pytest.raises(EprtError, match=refusal(ck, keys, "--kv-cache nvfp4") + "$"):
        run_ptq(ParallelState.single(), PTQArgs(ck, None, out, kv_cache="nvfp4", auto_quantize=6.0, progress=False))
    assert not os.path.exists(out)


@pytest.mark.parametrize("recipe", [["--recipe", "fp8"], []])
def test_the_dry_run_refuses_it(deepseek, monkeypatch, capsys, recipe):
    ck, keys = deepseek
    monkeypatch.setattr(sys, "argv", ["eprt-ptq", ck, "--dry-run", *recipe, "--kv-cache", "fp8"])
    assert command.ptq() == 0 and "memory plan" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["eprt-ptq", ck, "--dry-run", *recipe, "--kv-cache", "nvfp4"])
    with pytest.raises(EprtError, match=refusal(ck, keys, "--kv-cache nvfp4") + "$"):
        command.ptq()


def test_a_family_whose_cache_eprt_does_not_calibrate_says_so(caplog):
    """DeepSeek-V4's attention hands no keys and values to the KV taps (vLLM scales its FP8 cache
    itself and reads no scale): a KV-cache format is not refused (the recipes that name one still
    run) but said to write no scales, naming the family."""
    config = parse_hf_config(tiny_config("deepseek_v4"))
    model = model_class(config)(config)
    assert not [m for m in model.modules() if isinstance(getattr(m, "taps", None), KVTaps)]
    with caplog.at_level(logging.WARNING, logger="eprt"):
        check_kv_cache("fp8", config, "CK")
    assert "CK (deepseek_v4) has a KV cache its engine scales itself" in caplog.text
