"""Write an eprt checkpoint back in the Hugging Face layout (for a calibrated one, the ModelOpt or
the compressed-tensors quantized layout). Under torchrun every rank writes its share of the shards.

    eprt-export CKPT OUT [--format modelopt|compressed-tensors] [--max-shard-size 5GB] [--dequantize] [--overwrite]   (or python tools/export_hf.py)
    eprt-export CKPT OUT --recipe fp8_block [--algorithm max|mse]   # quantize without calibration (a data-free recipe)
    torchrun --nproc-per-node N $(which eprt-export) CKPT OUT
"""

from eprt.cli import command_parser, run
from eprt.hf.export import DEFAULT_SHARD_BYTES, export_hf
from eprt.parallel import ParallelState
from eprt.units import parse_size


def export() -> None:
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
        metavar="modelopt|compressed-tensors",
        help="a calibrated checkpoint, or with --recipe: the quantized layout, modelopt (hf_quant_config.json, "
        "quant_method modelopt) or compressed-tensors (llm-compressor's); default: modelopt where it holds "
        "every format of the recipe, else compressed-tensors (INT4, W4A8, MXFP4)",
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
    a = ap.parse_args()
    # after the arguments: --help answers without torch

    with ParallelState.from_env() as state:
        shard = parse_size(a.max_shard_size, "--max-shard-size") if a.max_shard_size else DEFAULT_SHARD_BYTES
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


def main() -> None:
    run(export)


if __name__ == "__main__":
    main()
