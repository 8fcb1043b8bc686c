"""Check a quantized Hugging Face export against the layout vLLM and SGLang load: ModelOpt's
(one format or MIXED_PRECISION), or compressed-tensors' when its config says so, or GPT-OSS's
release layout (quant_method mxfp4: eprt.hf.check_mxfp4_blocks).

    eprt-check OUT [--source HF_DIR]                                    (or python tools/check_export.py)

Prints one line per violation, each naming the tensor, module or config key at fault, and exits
1 when there is any; prints "OUT: ok" and exits 0 otherwise, after a "warning:" line for each engine
quirk the export runs into (eprt.hf.check_engine_quirks), which a recipe avoids. A compressed-tensors
export is read by the compressed-tensors library's own classes where it is installed; without it,
by eprt's own table of its schemes, and a "note:" line says so.
"""

import importlib.util
import sys
from pathlib import Path

from eprt.cli import command_parser, run
from eprt.storage.hf_files import CONFIG


def check(argv: list[str] | None = None) -> int:
    ap = command_parser(__doc__, "export")
    ap.add_argument("out", help="the exported Hugging Face directory")
    ap.add_argument(
        "--source",
        help="the Hugging Face checkpoint it was exported from: the export must hold "
        "exactly its tensors, each quantized Linear's weight replaced by its scales",
    )
    a = ap.parse_args(argv)
    # the checks import torch: after the arguments, so that --help answers at once
    from eprt.hf.check_engine_quirks import engine_warnings
    from eprt.hf.check_export import check_export, is_compressed_tensors
    from eprt.hf.check_files import read_json
    from eprt.hf.check_unmodeled import not_modeled

    library = importlib.util.find_spec("compressed_tensors") is not None
    problems = check_export(a.out, a.source, library=library)
    if not library and is_compressed_tensors(read_json(Path(a.out) / CONFIG, [])):
        print(
            "note: the compressed-tensors library is not installed, so its config was read by eprt's own table of "
            "its schemes; pip install 'eprt[compressed]' to check it with the library's classes"
        )
    for p in problems:
        print(p)
    if problems:
        print(f"{a.out}: {len(problems)} violation(s) of the quantized export layout")
        return 1
    for w in engine_warnings(a.out):
        print(f"warning: {w}")
    note = not_modeled(read_json(Path(a.out, CONFIG), []))
    if note:
        print(note)
    print(f"{a.out}: ok")
    return 0


def main() -> int:
    return run(check)


if __name__ == "__main__":
    sys.exit(main())
