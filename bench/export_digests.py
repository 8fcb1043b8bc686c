"""SHA-256 of every file of every export, for every family x shipped recipe x algorithm x layout
of the quantized export: the bytes a refactoring must leave unchanged.

    python bench/export_digests.py --out digests.json          # write today's digests
    python bench/export_digests.py --against digests.json      # compare; exit 1 on any difference

Each tiny model of eprt.testing.tiny is converted, calibrated in one process (its data, sizes and
seeds fixed) with each shipped recipe (the FP8 KV cache on, where the recipe leaves it open) and
each algorithm, and exported in the ModelOpt and the compressed-tensors layout. A refusal is recorded by its message, so a refusal that changes is a difference
too. The unquantized round trip (convert, export) is recorded per family as well.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from eprt.errors import EprtError  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402

FAMILIES = (
    "qwen3_moe",
    "deepseek_v3",
    "glm4_moe",
    "deepseek_v32",
    "kimi_linear",
    "kimi_k3",
    "kimi_k25",
    "qwen3_next",
    "qwen3_5_moe",
)
# the sources users hold in other formats: (name, family, make_tiny keywords)
SOURCES = (
    ("kimi_k2-int4", "deepseek_v3", dict(source_format="int4", model_type="kimi_k2", num_nextn_predict_layers=0)),
    (
        "deepseek_v3-fp8_block",
        "deepseek_v3",
        dict(source_format="fp8-block", hidden_size=192, intermediate_size=304, moe_intermediate_size=144),
    ),
    ("kimi_k3-mxfp4", "kimi_k3", dict(source_format="mxfp4")),
    ("qwen3_5_moe-fused", "qwen3_5_moe", dict(fused_experts=True)),
)

RECIPES_DIR = os.path.join(REPO, "eprt", "configs", "ptq")
ALGORITHMS = ("max", "mse", "gptq", "awq", "awq+gptq")
EXPORTS = {"modelopt": {}, "compressed-tensors": {"fmt": "compressed-tensors"}}


def digest_dir(path: str) -> dict:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def shipped_recipes() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(RECIPES_DIR) if f.endswith(".yaml"))


def refused(e: EprtError, tmp: str) -> str:
    return "refused: " + str(e).replace(tmp, "TMP")


def run_case(ck: str, root: str, recipe: str, algorithm: str, tmp: str) -> dict:
    """{export kind: {file: sha256} or "refused: ..."}, or the calibration's refusal."""
    out = os.path.join(root, f"{recipe}-{algorithm}")
    try:
        run_ptq(
            ParallelState.single(),
            PTQArgs(
                ck,
                recipe,
                out,
                kv_cache="fp8",
                calib_size=6,
                seq_len=24,
                group_tokens=48,
                eval_size=2,
                algorithm=algorithm,
                gptq_min_tokens=1,
                progress=False,
            ),
        )
    except EprtError as e:
        return {"ptq": refused(e, tmp)}
    result = {}
    for kind, kw in EXPORTS.items():
        dst = os.path.join(root, f"{recipe}-{algorithm}-{kind}")
        try:
            result[kind] = digest_dir(export_hf(out, dst, progress=False, **kw))
        except EprtError as e:
            result[kind] = refused(e, tmp)
    return result


def all_digests(families: list[str], recipes: list[str], algorithms: list[str]) -> dict:
    digests = {}
    models = [(f, f, {}) for f in families] + [s for s in SOURCES if s[1] in families]
    with tempfile.TemporaryDirectory() as tmp:
        for name, family, kw in models:
            start = time.perf_counter()
            root = os.path.join(tmp, name)
            ck = convert_hf(make_tiny(family, os.path.join(root, "hf"), **kw), os.path.join(root, "ck"), progress=False)
            digests[f"{name}/unquantized"] = digest_dir(export_hf(ck, os.path.join(root, "rt"), progress=False))
            if "source_format" in kw:  # a source stored compressed or in block FP8 decodes
                digests[f"{name}/decoded"] = digest_dir(
                    export_hf(ck, os.path.join(root, "rt-bf16"), progress=False, dequantize=True)
                )
            for recipe in recipes if name == family else recipes[:1]:
                for algorithm in algorithms:
                    digests[f"{name}/{recipe}/{algorithm}"] = run_case(ck, root, recipe, algorithm, tmp)
            print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return digests


def differences(now: dict, before: dict) -> list[str]:
    lines = []
    for case in sorted(set(now) | set(before)):
        a, b = now.get(case), before.get(case)
        if a != b:
            lines.append(f"{case}:\n  before: {json.dumps(b)[:400]}\n  now:    {json.dumps(a)[:400]}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the digests here (JSON)")
    p.add_argument("--against", help="compare with digests written before; exit 1 on any difference")
    p.add_argument("--family", action="append", help="only these families (default: all)")
    p.add_argument("--recipe", action="append", help="only these shipped recipes (default: all)")
    p.add_argument("--algorithm", action="append", choices=ALGORITHMS, help="only these (default: all)")
    a = p.parse_args()
    digests = all_digests(a.family or list(FAMILIES), a.recipe or shipped_recipes(), a.algorithm or list(ALGORITHMS))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(digests, f, indent=1, sort_keys=True)
    if a.against:
        with open(a.against) as f:
            before = json.load(f)
        before = {k: v for k, v in before.items() if k in digests}  # a subset run compares its own cases
        diff = differences(digests, before)
        print("\n".join(diff) if diff else f"{len(digests)} cases: every file the same bytes")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
