"""A PTQ run's settings (`PTQArgs`): each field is also the command's flag (eprt.flags builds
eprt-ptq's parser from them), and every part of the run reads them from here: the dispatch and the
calibrated run (eprt.quant.run.ptq), the data-free run (eprt.quant.run.datafree), the format search
(eprt.quant.algorithms.search.auto_quantize_run)."""

from __future__ import annotations

from dataclasses import dataclass

from eprt.flags import flag
from eprt.quant.algorithms.registry import option_default, option_flags, run_options
from eprt.quant.algorithms.registry import sequences as algorithm_sequences
from eprt.quant.algorithms.search.budget import DEFAULT_CANDIDATES, parse_budget
from eprt.units import parse_size

# This module imports no torch: a command's parser is built from PTQArgs, and `--help` answers
# before the model code loads. The vocabulary of the flags lives here for that reason.

# `--dtype`: the dtype the model runs in, by its torch name (eprt.quant.run.setup.run_dtype)
RUN_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# `--kv-cache`: the KV-cache formats (eprt.quant.formats.kv holds them, by these names)
KV_CACHE_NAMES = ("fp8", "nvfp4")
# `--calib-rows`: how documents make sequences (eprt.samples)
ROWS = ("pack", "truncate", "pad")
# `--preview` without a prompt
DEFAULT_PROMPT = "The river ran low in late summer, and"
ALGORITHMS = algorithm_sequences()


def _max_memory(text: str) -> int:
    return parse_size(text, "--max-memory")


def _max_host_memory(text: str) -> int:
    return parse_size(text, "--max-host-memory")


@dataclass(frozen=True)
class PTQArgs:
    """A PTQ run's settings; each flag field is also its command-line flag (eprt.flags)."""

    ckpt: str = flag(help="the eprt checkpoint to quantize (eprt-convert writes one)", positional=True)
    recipe: str | None = flag(help="a recipe of eprt/configs/ptq (fp8, nvfp4, nvfp4_experts_only) or a YAML path")
    out: str | None = flag(help="where to write the quantized eprt checkpoint")
    ep: int | None = flag(
        help="expert-parallel degree; divides the world size and the routed experts (default: the world size)"
    )
    kv_cache: str | None = flag(choices=KV_CACHE_NAMES, help="also quantize the KV cache")
    auto_quantize: float | None = flag(
        type=parse_budget,
        metavar="BUDGET",
        help="search each module group's format under BUDGET effective bits per active parameter (e.g. "
        "4.8bits) instead of --recipe; writes the chosen recipe into OUT (docs/quality.md, 'Format search')",
    )
    auto_quantize_formats: str = flag(
        ",".join(DEFAULT_CANDIDATES),
        metavar="FORMATS",
        help=f"the formats --auto-quantize chooses from, comma-separated (default {','.join(DEFAULT_CANDIDATES)})",
    )
    algorithm: str = flag(
        ALGORITHMS[0],
        choices=ALGORITHMS,
        help=f"how weight scales are chosen, for the recipe rules that name no algorithm: "
        f"{', '.join(ALGORITHMS)} (default {ALGORITHMS[0]}; docs/export.md, 'Weight scales')",
    )
    # an algorithm's run option (eprt.quant.algorithms.registry.option_flags): its meaning is the
    # algorithm's, its flag the run's
    gptq_min_tokens: int = flag(
        option_default("gptq_min_tokens"),
        help=f"with gptq, a routed expert with fewer calibration tokens keeps max rounding "
        f"and is listed (default {option_default('gptq_min_tokens')})",
    )
    calib: tuple[str, ...] = flag(
        (),
        metavar="DATA[:SHARE]",
        help="calibration data: .txt, .jsonl (text or chat messages), .parquet, a saved "
        "dataset directory, .npy or .safetensors (default: built-in text); repeat with "
        "a share each to mix sources (--calib chat.jsonl:0.7 --calib code.txt:0.3)",
    )
    calib_column: str | None = flag(
        help="the column (JSONL field) of every --calib source to read (default: text, "
        "else messages, rendered with the checkpoint's chat template)"
    )
    calib_rows: str = flag(
        "pack",
        choices=ROWS,
        help="how documents make sequences: pack (end to end), truncate (one a sequence, cut at --seq-len, "
        "shorter ones skipped) or pad (one a sequence, a shorter one padded) (default pack)",
    )
    seed: int | None = flag(help="take each --calib source's documents in an order shuffled by this seed")
    calib_size: int = flag(64, help="calibration sequences, over all ranks")
    seq_len: int = flag(256, help="tokens per calibration sequence")
    eval_size: int = flag(
        8,
        help="held-out sequences of the quality report (KL, top-1 agreement, perplexity, "
        "per-layer errors; docs/quality.md), taken after the calibration sequences unless "
        "--eval; 0: no report",
    )
    eval: str | None = flag(
        help="the quality report's held-out data (.txt, .jsonl, .npy or .safetensors) instead of "
        "the sequences after the calibration ones"
    )
    batch_size: int = flag(1, help="sequences per forward on each rank")
    dtype: str = flag("bf16", choices=list(RUN_DTYPES), help="the dtype the model runs in")
    preview: str | None = flag(
        const=DEFAULT_PROMPT,
        metavar="PROMPT",
        help="print the greedy continuation of PROMPT (or of a built-in one) before and after quantization",
    )
    chunk_size: int | None = flag(
        help="calibration sequences per step of each layer, over all ranks (default: "
        "--batch-size x the world size); changes no result"
    )
    calibrate_all_experts: bool = flag(
        False,
        help="also run every token through every routed expert of its layer, "
        "for the statistics and GPTQ's Hessians only (the layer's output still uses its "
        "top-k): no expert goes uncalibrated",
    )
    max_memory: int | None = flag(
        type=_max_memory,
        help="refuse a run whose planned peak per rank on its device exceeds this (e.g. "
        "64GiB; default: the device's free memory, or on CPU the host's available "
        "RAM)",
    )
    max_host_memory: int | None = flag(
        type=_max_host_memory,
        help="with GPUs, refuse a run whose ranks on one host together plan more "
        "host memory than this (e.g. 1TiB; default: the host's available RAM)",
    )
    work_dir: str | None = flag(help="where each layer boundary is saved for --resume (default: OUT.work)")
    resume: bool = flag(False, help="continue a killed run (same arguments) after its last completed layer")
    save_every: int = flag(
        1,
        metavar="N",
        help="save the layer boundary to the work directory after every N-th layer (0: never; a killed run "
        "then starts over); --estimate-time counts the saves",
    )
    dry_run: bool = flag(False, help="print the layout, each rank's weight bytes and planned peak memory, and exit")
    estimate_time: bool = flag(
        False,
        help="with --dry-run and --recipe, also estimate the calibration's wall time: a probe runs one layer "
        "of each kind at random on this machine's device (on the GPU node the run will use)",
    )
    device: str | None = flag(
        choices=["cpu", "cuda"],
        help="with --dry-run, plan for ranks on this device (default: this machine's), e.g. "
        "GPU ranks planned from a login node without GPUs",
    )
    overwrite: bool = flag(False, help="replace a non-empty OUT once the new one is complete")
    progress: bool = True
    group_tokens: int | None = None  # tokens per expert work unit's group of sequences (default: from the model)


# what only calibration reads: a data-free run names those given as unused
CALIBRATION_SETTINGS = (
    "ep",
    "calib",
    "calib_column",
    "calib_rows",
    "seed",
    "calib_size",
    "seq_len",
    "eval_size",
    "batch_size",
    "chunk_size",
    "dtype",
    "calibrate_all_experts",
    *option_flags(),  # each algorithm's run options
    "work_dir",
    "resume",
    "save_every",
    "max_memory",
    "max_host_memory",
    "device",
)


def algorithm_options(a: PTQArgs) -> dict[str, object]:
    """Each algorithm's run options, from their flags (eprt.quant.algorithms.registry.option_flags),
    refused by flag where one is out of range."""
    return run_options({field: getattr(a, field) for field in option_flags()})
