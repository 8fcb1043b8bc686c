"""Write an eprt checkpoint back in the Hugging Face layout (for a calibrated one, the ModelOpt or
the compressed-tensors quantized layout). Under torchrun every rank writes its share of the shards.

    eprt-export CKPT OUT [--format modelopt|compressed-tensors|mxfp4] [--max-shard-size 5GB] [--dequantize] [--overwrite]   (or python tools/export_hf.py)
    eprt-export CKPT OUT --recipe fp8_block [--algorithm max|mse]   # quantize without calibration (a data-free recipe)
    torchrun --nproc-per-node N $(which eprt-export) CKPT OUT
    eprt-export HF_DIR OUT --recipe fp8_block [--workers N] [--dry-run]   # model-free: any Hugging Face checkpoint
    eprt-export --nproc-per-node N HF_DIR OUT --recipe fp8_block        # model-free, N local ranks

A Hugging Face directory (config.json and safetensors, no eprt.json) is quantized straight from its
shards under a data-free recipe, whatever its model_type (eprt.hf.streaming, docs/export.md).
"""

import os
import sys

from eprt.cli import command_parser, run
from eprt.commands.launch import launch, without_nproc
from eprt.errors import ConfigError
from eprt.storage.hf_files import CONFIG
from eprt.units import parse_size


def export() -> int:
    ap = command_parser(__doc__, "export")
    ap.add_argument("ckpt")
    ap.add_argument("out")
    ap.add_argument(
        "--max-shard-size", help="largest safetensors shard, e.g. 4GiB, 500MB (default 5GiB, 5 x 1024^3 bytes)"
    )
    ap.add_argument(
        "--dequantize",
        action="store_true",
        help="an unquantized checkpoint only: write weights the source stored compressed or in block "
        "FP8 decoded (bf16), and config.json without its quantization_config (default: as the "
        "source stored them)",
    )
    ap.add_argument(
        "--format",
        metavar="modelopt|compressed-tensors|mxfp4",
        help="a calibrated checkpoint, or with --recipe: the quantized layout, modelopt (hf_quant_config.json, "
        "quant_method modelopt) or compressed-tensors (llm-compressor's); default: modelopt where it holds "
        "every format of the recipe, else compressed-tensors (INT4, W4A8, MXFP4); mxfp4: GPT-OSS's release "
        "layout (quant_method mxfp4), for its routed experts alone in MXFP4 (recipe mxfp4_experts_only), "
        "which vLLM loads as it loads the release",
    )
    ap.add_argument(
        "--recipe",
        help="an unquantized checkpoint only: quantize it on the way out under this recipe (a shipped one, "
        "eprt-quantize --list-recipes, or a YAML path), one whose formats take no activation statistic "
        "(fp8_block, fp8_channel, int4, mxfp4, ...) and that quantizes no KV cache: the export eprt-ptq and "
        "eprt-export write, without calibration data; other recipes are refused (calibrate with eprt-ptq)",
    )
    ap.add_argument(
        "--algorithm",
        metavar="max|mse",
        help="with --recipe, how weight scales are chosen for its rules that name no algorithm (default max)",
    )
    ap.add_argument(
        "--base-model",
        metavar="HUB_ID",
        help="a quantized export: the Hub id its model card names as base_model (default: the one the source's "
        "config.json or its Hugging Face cache directory says)",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT once the new one is complete")
    ap.add_argument("--no-progress", action="store_true")
    ap.add_argument(
        "--workers",
        type=int,
        default=1,
        help="a Hugging Face directory (model-free): processes on this host writing shards side by side (default 1)",
    )
    ap.add_argument(
        "--nproc-per-node",
        type=int,
        help="a Hugging Face directory (model-free): start N local ranks, each with --workers",
    )
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="a Hugging Face directory (model-free): print the plan (shards, what is quantized, memory) and write nothing",
    )
    a = ap.parse_args()
    # after the arguments: --help answers without torch
    from eprt.hf.export import DEFAULT_SHARD_BYTES, export_hf
    from eprt.hf.streaming import stream_export
    from eprt.parallel import ParallelState
    from eprt.quant.run.datafree import data_free_formats

    shard = parse_size(a.max_shard_size, "--max-shard-size") if a.max_shard_size else DEFAULT_SHARD_BYTES
    model_free = is_hf_dir(a.ckpt)
    if not model_free and (a.workers != 1 or a.nproc_per_node is not None or a.dry_run):
        raise ConfigError(
            f"--workers, --nproc-per-node and --dry-run are for a Hugging Face directory; {a.ckpt} is an eprt "
            f"checkpoint: run torchrun --nproc-per-node N $(which eprt-export) {a.ckpt} {a.out} for ranks"
        )
    if model_free and a.recipe is None:
        raise ConfigError(
            f"{a.ckpt} is a Hugging Face directory: give a data-free --recipe ({', '.join(data_free_formats())} "
            "formats) to quantize it straight from its shards, or convert it first (eprt-convert)"
        )
    if model_free and a.dequantize:
        raise ConfigError(
            f"--dequantize with --recipe {a.recipe}: a quantized export always starts from decoded weights"
        )
    if a.nproc_per_node is not None:
        return launch("eprt.commands.export", without_nproc(sys.argv[1:]), a.nproc_per_node)
    with ParallelState.from_env() as state:
        if model_free:
            stream_export(
                a.ckpt,
                a.out,
                a.recipe,
                algorithm=a.algorithm,
                fmt=a.format,
                workers=a.workers,
                max_shard_bytes=shard,
                overwrite=a.overwrite,
                dry_run=a.dry_run,
                progress=not a.no_progress,
                parallel=state,
                base_model=a.base_model,
            )
            return 0
        export_hf(
            a.ckpt,
            a.out,
            max_shard_bytes=shard,
            overwrite=a.overwrite,
            progress=not a.no_progress,
            dequantize=a.dequantize,
            parallel=state,
            fmt=a.format,
            recipe=a.recipe,
            algorithm=a.algorithm,
            base_model=a.base_model,
        )
    return 0


def is_hf_dir(path: str) -> bool:
    """A Hugging Face checkpoint directory (its config.json, no eprt manifest), which the export quantizes model-free."""
    from eprt.storage.checkpoint import MANIFEST

    return os.path.isfile(os.path.join(path, CONFIG)) and not os.path.isfile(os.path.join(path, MANIFEST))


def main() -> int:
    return run(export)


if __name__ == "__main__":
    sys.exit(main())
