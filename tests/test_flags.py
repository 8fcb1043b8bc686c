"""A setting is written once: eprt-ptq's parser is built from PTQArgs' fields, so what the command line
reads is the run's argument object, defaults and all; sizes read as the README writes them."""

import argparse
from dataclasses import dataclass

import pytest

from eprt.commands.ptq import parse_args
from eprt.errors import ConfigError
from eprt.flags import add_flags, flag, from_flags
from eprt.quant.run.args import DEFAULT_PROMPT
from eprt.quant.run.ptq import PTQArgs
from eprt.units import parse_size


def test_no_flag_given_is_the_run_objects_defaults():
    assert parse_args(["CKPT"]) == (PTQArgs("CKPT"), None)


def test_each_kind_of_flag_reads_into_its_field():
    a, nproc = parse_args(
        [
            "CKPT",
            "--nproc-per-node",
            "2",
            "--recipe",
            "nvfp4",
            "--out",
            "Q",
            "--ep",
            "2",
            "--calib-size",
            "16",
            "--max-memory",
            "1.5TB",
            "--calibrate-all-experts",
            "--preview",
            "--kv-cache",
            "fp8",
            "--algorithm",
            "gptq",
            "--dry-run",
        ]
    )
    assert nproc == 2
    assert a == PTQArgs(
        "CKPT",
        "nvfp4",
        "Q",
        ep=2,
        calib_size=16,
        max_memory=1_500_000_000_000,
        calibrate_all_experts=True,
        preview=DEFAULT_PROMPT,
        kv_cache="fp8",
        algorithm="gptq",
        dry_run=True,
    )
    assert parse_args(["CKPT", "--preview", "Once upon"])[0].preview == "Once upon"


@pytest.mark.parametrize(
    "text, size",
    [
        ("4096", 4096),
        ("500MB", 500 * 10**6),
        ("64GiB", 64 * 2**30),
        ("1.5TB", 1_500_000_000_000),
        ("2TiB", 2 * 2**40),
        ("5 gb", 5 * 10**9),
    ],
)
def test_sizes_are_decimal_with_kb_to_tb_and_binary_with_kib_to_tib(text, size):
    assert parse_size(text) == size


def test_a_size_in_no_known_unit_is_refused_naming_the_flag():
    with pytest.raises(ConfigError, match=r"^--max-memory '64 gigs': write a number with an optional unit"):
        parse_args(["CKPT", "--max-memory", "64 gigs"])


def test_a_tuple_field_is_a_flag_given_again_and_again():
    @dataclass(frozen=True)
    class Args:
        data: tuple[str, ...] = flag(("built-in",), help="data files")
        shares: tuple[float, ...] = flag((), help="their shares")

    parser = argparse.ArgumentParser()
    add_flags(parser, Args)
    assert from_flags(Args, parser.parse_args([])) == Args()
    assert from_flags(Args, parser.parse_args(["--data", "a", "--data", "b", "--shares", "0.5"])) == Args(
        ("a", "b"), (0.5,)
    )


def test_the_flags_offer_exactly_the_formats_and_dtypes_the_run_has():
    """The parser's vocabulary is written where no torch is imported (so `--help` is quick): it
    offers each KV-cache format, calibration-row mode and run dtype the run itself knows, no other."""
    import torch

    from eprt.quant.formats.kv import KV_CACHE_FORMATS
    from eprt.quant.run.args import KV_CACHE_NAMES, RUN_DTYPES
    from eprt.quant.run.setup import run_dtype

    assert KV_CACHE_NAMES == tuple(KV_CACHE_FORMATS)
    assert {n: run_dtype(n) for n in RUN_DTYPES} == {"bf16": torch.bfloat16, "fp32": torch.float32}
    with pytest.raises(ConfigError, match=r"--dtype 'fp16': choose one of bf16, fp32"):
        run_dtype("fp16")
