"""Convert a Hugging Face safetensors checkpoint into an eprt checkpoint.

    eprt-convert HF_DIR OUT [--dtype keep|bf16|fp32] [--reference] [--overwrite]      (or python tools/convert_hf.py)

Weights the source stores compressed (compressed-tensors: Kimi's INT4 and MXFP4 experts; needs
`pip install compressed-tensors`) or in block FP8 (DeepSeek-V3) are kept as they are; loading
decodes each rank's share.
"""

from eprt.cli import command_parser, run


def convert() -> None:
    ap = command_parser(__doc__, "checkpoint-format")
    ap.add_argument("hf_dir")
    ap.add_argument("out")
    ap.add_argument(
        "--dtype",
        default="keep",
        metavar="keep|bf16|fp32",
        help="cast floating-point weights (default: keep the source dtypes); compressed and "
        "block-FP8 weights stay as stored",
    )
    ap.add_argument(
        "--reference",
        action="store_true",
        help="copy no weight the source holds as eprt reads it: OUT reads the source's files in place "
        "(pinned: a changed source is refused), so converting costs what reading the headers costs",
    )
    ap.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT once the new one is complete")
    ap.add_argument("--no-progress", action="store_true")
    a = ap.parse_args()
    from eprt.hf.convert import convert_hf  # after the arguments: --help answers without torch

    convert_hf(a.hf_dir, a.out, dtype=a.dtype, overwrite=a.overwrite, progress=not a.no_progress, reference=a.reference)


def main() -> None:
    run(convert)


if __name__ == "__main__":
    main()
