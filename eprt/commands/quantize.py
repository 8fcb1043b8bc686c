"""From a Hugging Face model to a quantized one its engines serve, in one command.

    eprt-quantize HF_DIR OUT --recipe nvfp4 [--nproc-per-node N] [--calib DATA] [...]
    eprt-quantize HF_DIR OUT --target hopper            # the recipe Hopper GPUs run, picked
    eprt-quantize --list-recipes

It converts HF_DIR (reading its weight files in place: no second copy), calibrates on N local
ranks (or, for a recipe that takes no activation statistic, quantizes without data), exports in
the layout that holds the recipe, checks the export against HF_DIR, writes its model card, and
prints where the output is, which GPUs serve it and the commands that serve it. Everything but
OUT lives in a work directory beside it (OUT.work) until the export is written: the same command
run again after a failure or a kill continues where it stopped. eprt-convert, eprt-ptq,
eprt-export and eprt-check run the steps one at a time.
"""

from __future__ import annotations

import argparse
import sys

from eprt.cli import command_parser, run

# eprt-ptq's options this command passes on when given; their defaults are eprt-ptq's
# (tests/test_quantize.py holds them equal)
CALIBRATION = {
    "--calib": (
        "DATA[:SHARE]",
        "calibration data (.txt, .jsonl, .parquet, a saved dataset, token ids); "
        "repeat with a share each to mix; `builtin` for eprt's small built-in text (default: refused "
        "for a model above 1B parameters, whose scales it would set from 1,135 tokens)",
    ),
    "--calib-column": ("NAME", "the column of every --calib source to read (default: text, else messages)"),
    "--calib-rows": (
        "pack|truncate|pad",
        "how documents make sequences: end to end, or one a sequence cut at --seq-len (shorter ones skipped, or "
        "padded) (default pack)",
    ),
    "--seed": ("N", "take the documents in an order shuffled by this seed (default: the file's order)"),
    "--calib-size": ("N", "calibration sequences, over all ranks (default 64)"),
    "--seq-len": ("N", "tokens per calibration sequence (default 256)"),
    "--eval-size": ("N", "held-out sequences of the quality report; 0: no report (default 8)"),
    "--eval": ("DATA", "the quality report's held-out data (default: the sequences after the calibration ones)"),
}
ALGORITHM = {
    "--algorithm": ("NAME", "how weight scales are chosen: max, mse, gptq, awq, awq+gptq (default max)"),
    "--kv-cache": ("FORMAT", "also quantize the KV cache: fp8, nvfp4 (default: as the recipe says)"),
}
RANKS = {
    "--ep": ("N", "expert-parallel degree; divides N and the routed experts (default: N)"),
    "--batch-size": ("N", "sequences per forward on each rank (default 1)"),
}
SWITCHES = {
    "--calibrate-all-experts": "also run every token through every routed expert, for the statistics only",
}
BUILTIN = "builtin"  # --calib's word for the built-in text


def parser() -> argparse.ArgumentParser:
    ap = command_parser(__doc__, "quickstart", prog="eprt-quantize")
    ap.epilog = f"Any other eprt-ptq option goes after `--` (eprt-ptq --help). {ap.epilog}"
    ap.add_argument("hf_dir", nargs="?", metavar="HF_DIR", help="the Hugging Face model directory (safetensors)")
    ap.add_argument("out", nargs="?", metavar="OUT", help="where to write the quantized model")
    what = ap.add_argument_group("what to make")
    what.add_argument("--recipe", help="a recipe (--list-recipes) or a YAML path (default: the one --target picks)")
    what.add_argument(
        "--target",
        metavar="GPU",
        help="the GPUs that will serve it: ampere, ada, hopper, blackwell, or a GPU (H200, B200, ...): picks "
        "the recipe, or refuses one they do not run (default: no check)",
    )
    what.add_argument(
        "--format",
        choices=["modelopt", "compressed-tensors", "mxfp4"],
        help="the export's layout (default: modelopt where it holds the recipe, else compressed-tensors; "
        "mxfp4: GPT-OSS's release layout of its MXFP4 routed experts, recipe mxfp4_experts_only)",
    )
    what.add_argument("--list-recipes", action="store_true", help="list the shipped recipes and the GPUs that run each")
    groups = {title: ap.add_argument_group(title) for title in ("calibration data", "algorithm", "ranks")}
    for title, options in (("calibration data", CALIBRATION), ("algorithm", ALGORITHM), ("ranks", RANKS)):
        for flag, (metavar, text) in options.items():
            action = "append" if flag == "--calib" else "store"
            groups[title].add_argument(flag, metavar=metavar, action=action, help=text)
    for flag, text in SWITCHES.items():
        groups["algorithm"].add_argument(flag, action="store_true", help=text)
    groups["ranks"].add_argument(
        "--nproc-per-node", type=int, metavar="N", help="calibrate on N local ranks (default: one process)"
    )
    output = ap.add_argument_group("output")
    output.add_argument(
        "--chat-template",
        metavar="FILE",
        help="render chat calibration data with this Jinja template (default: the model's own); the export carries it",
    )
    output.add_argument("--base-model", metavar="HUB_ID", help="the model card's base_model (default: from HF_DIR)")
    output.add_argument("--work-dir", help="where the steps' outputs wait until OUT is written (default: OUT.work)")
    output.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT once the new one is complete")
    output.add_argument("--quiet", action="store_true", help="no progress bar; warnings and the summary only")
    return ap


def parse(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """The command's settings, and the eprt-ptq arguments they pass on (those after `--` last)."""
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    mine = argv[: argv.index("--")] if "--" in argv else argv
    a = parser().parse_args(mine)
    # `--calib builtin`: eprt-ptq's default data, asked for; the files given stay in a.calib
    a.builtin = BUILTIN in (a.calib or [])
    a.calib = [c for c in a.calib or [] if c != BUILTIN]
    passed = []
    for flag in (*CALIBRATION, *ALGORITHM, *RANKS):
        value = getattr(a, flag[2:].replace("-", "_"))
        for v in value if isinstance(value, list) else [value]:
            if v is not None:
                passed += [flag, v]
    passed += [flag for flag in SWITCHES if getattr(a, flag[2:].replace("-", "_"))]
    return a, passed + extra


def quantize(argv: list[str] | None = None) -> int:
    a, ptq_args = parse(sys.argv[1:] if argv is None else argv)
    if a.list_recipes:
        from eprt.hf.serving import list_recipes

        print(list_recipes())
        return 0
    if not (a.hf_dir and a.out):
        parser().error("HF_DIR and OUT are required (or --list-recipes)")
    from eprt.commands.quantize_run import Run

    return Run.of(a, ptq_args).run()


def main() -> int:
    quiet = "--quiet" in sys.argv[1:]
    return run(lambda: quantize(), quiet=quiet)


if __name__ == "__main__":
    sys.exit(main())
