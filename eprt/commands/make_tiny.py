"""Write a tiny random Hugging Face checkpoint (real tensor names, a real tokenizer.json), stored
as the family's release stores it (Mistral-Small-4: per-tensor FP8, its experts fused).

eprt-make-tiny qwen3_moe OUT [--shards 3] [--dtype bf16|fp32] [--seed 0] [--source-format mxfp8]
(or python tools/make_tiny.py)
"""

from eprt.cli import command_parser, run


def make() -> None:
    ap = command_parser(__doc__, "models")
    ap.add_argument("family", help="qwen3_moe, deepseek_v3, kimi_linear, kimi_k3, ... (a wrong one lists them all)")
    ap.add_argument("out")
    ap.add_argument("--shards", type=int, default=1, help="number of safetensors files (an index when > 1)")
    ap.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--overwrite", action="store_true")
    ap.add_argument(
        "--source-format",
        help="store it encoded as this release is (int4, mxfp4, mxfp4-blocks, fp8-block, fp8-tensor, mxfp8; a wrong one lists them all)",
    )
    a = ap.parse_args()
    from eprt.testing.tiny import SOURCE_FORMATS, families, make_tiny, released  # after --help: they import torch

    if a.family not in families():
        ap.error(f"argument family: invalid choice: {a.family!r} (choose from {', '.join(families())})")
    if a.source_format is not None and a.source_format not in SOURCE_FORMATS:
        ap.error(
            f"argument --source-format: invalid choice: {a.source_format!r} (choose from {', '.join(SOURCE_FORMATS)})"
        )
    release = released(a.family)
    if a.source_format is not None:
        release = {**release, "source_format": a.source_format}
    make_tiny(a.family, a.out, seed=a.seed, shards=a.shards, dtype=a.dtype, overwrite=a.overwrite, **release)
    print(a.out)


def main() -> None:
    run(make)


if __name__ == "__main__":
    main()
