"""SHA-256 of every file of every export, for every family x shipped recipe x algorithm x layout
of the quantized export: the bytes a refactoring must leave unchanged, and the bytes every (world,
ep) layout of the calibration must give.

    python bench/export_digests.py --out digests.json          # write today's digests
    python bench/export_digests.py --against digests.json      # compare; exit 1 on any difference
    python bench/export_digests.py --world 2 --ep 2 --against digests.json   # the same matrix on 2 ranks

Each tiny model of eprt.testing.tiny is converted, calibrated (its data, sizes and seeds fixed)
with each shipped recipe (the FP8 KV cache on, where the recipe leaves it open) and each
algorithm, and exported in the ModelOpt and the compressed-tensors layout. A refusal is recorded by
its message, so a refusal that changes is a difference too. The unquantized round trip (convert,
export) is recorded per family as well, and the MIXED recipes (the formats no shipped recipe
mixes, side by side in one model) beside the shipped ones. A recipe whose format's blocks do not fill an input dim of
the family's tiny model (INT4's and W4A8's groups of 128 beside a hidden size of 64) is refused
there, which is recorded, and runs again on the family's wide tiny model (`FAMILY-wide/...`, every
input dim a multiple of 128), so that every format exports from every family.

`--world N --ep E` calibrates every case on N CPU processes (gloo) at expert parallelism E and
exports it in this process: compared `--against` digests a single process wrote, it shows that
the layout changes no byte of any export.

A recipe `auto:BITS` is the format search at that budget (`--auto-quantize BITS`, its default
candidates), recorded as `NAME/auto:BITS/ALGORITHM`.

`--calibrate-all-experts` calibrates every case with that option (each routed expert's statistics
over every token of its layer), recorded as `NAME/RECIPE/ALGORITHM/all-experts`: the same matrix,
its own cases.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from datetime import timedelta

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from eprt.errors import EprtError  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import distinct_models, make_tiny, released, tiny_config  # noqa: E402
from tests.multiproc import run_world  # noqa: E402

FAMILIES = tuple(distinct_models())
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
    ("mistral4-fp8_tensor", "mistral4", released("mistral4")),
    ("minimax_m2-fp8_block", "minimax_m2", dict(source_format="fp8-block", hidden_size=192, intermediate_size=144)),
    ("minimax_m3_vl-mxfp8", "minimax_m3_vl", dict(source_format="mxfp8")),
    ("gpt_oss-mxfp4", "gpt_oss", released("gpt_oss")),
    ("deepseek_v4-fp8_fp4", "deepseek_v4", released("deepseek_v4")),
)
# Each family's wide tiny model: every Linear's input dim a multiple of 128 (the largest group of
# a format), the tiny config's other sizes kept. The low ranks and head widths that feed a
# projection are raised with them: MLA's q/kv ranks, the heads o_proj reads, KDA's head width
# (its f_b and g_b projections read it), the linear attention's heads.
WIDE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128)
MLA = dict(q_lora_rank=128, kv_lora_rank=128, v_head_dim=32)
LINEAR = dict(head_dim=32, shared_expert_intermediate_size=128, linear_key_head_dim=32, linear_value_head_dim=32)
NEMOTRON_H = dict(head_dim=32, mamba_head_dim=32, moe_latent_size=128, moe_shared_expert_intermediate_size=128)
WIDER = {
    "qwen3_moe": dict(head_dim=32),
    "glm4_moe": dict(head_dim=32),
    "deepseek_v3": MLA,
    "deepseek_v32": MLA,
    "glm_moe_dsa": MLA,
    "kimi_k25": MLA,
    "kimi_vl": MLA,
    "kimi_linear": dict(MLA, linear_attn_config={"head_dim": 128}),
    "kimi_k3": dict(MLA, routed_expert_hidden_size=128, linear_attn_config={"head_dim": 128}),
    "qwen3_next": LINEAR,
    "qwen3_5_moe": LINEAR,
    "mistral4": MLA,
    "minimax_m2": dict(head_dim=32),
    # the dense and shared MLPs have widths of their own; the indexer is never quantized
    "minimax_m3_vl": dict(head_dim=32, dense_intermediate_size=256, shared_intermediate_size=128),
    "minimax_m3_vl_text": dict(head_dim=32, dense_intermediate_size=256, shared_intermediate_size=128),
    "llama4": dict(head_dim=32, intermediate_size_mlp=256),  # o_proj reads 4 heads of 32; the dense layers' MLP
    # out_proj reads 4 Mamba heads of 32; the routed experts and fc2 read the latent; the shared expert its width
    "nemotron_h": NEMOTRON_H,
    "nemotron_h_omni": NEMOTRON_H,
    "gpt_oss": dict(head_dim=32),  # o_proj reads 4 heads of 32
    "deepseek_v4": dict(q_lora_rank=128, o_lora_rank=64),  # wq_b and the indexer's read q; wo_b 2 groups of 64
}
# Mixed recipes of the formats no shipped recipe mixes: routed experts in one, attention (and
# shared experts) in another, the rest unquantized; every data-free format in one of them.
MIXED = {
    "mixed_int4_fp8_block": {"*.experts": "int4", "*.self_attn.*": "fp8_block"},
    "mixed_mxfp4_mxfp8": {"*.experts": "mxfp4", "*.self_attn.*": "mxfp8"},
    "mixed_w4a8_fp8_channel_nvfp4_a16": {
        "*.experts": "w4a8",
        "*.self_attn.*": "fp8_channel",
        "*.shared_expert*": "nvfp4_a16",
    },
    "mixed_int4_g32_nvfp4_a16": {"*.experts": "int4_g32", "*.self_attn.*": "nvfp4_a16"},
}
INPUT_DIM_RULE = "is not a multiple of"  # eprt.quant.feasibility's refusal of a format's blocks
RECIPES_DIR = os.path.join(REPO, "eprt", "configs", "ptq")
ALGORITHMS = ("max", "mse", "gptq", "awq", "awq+gptq")
# each layout asked for by name: without --format an export takes the layout that holds its recipe
EXPORTS = {"modelopt": {"fmt": "modelopt"}, "compressed-tensors": {"fmt": "compressed-tensors"}}
AUTO = "auto:"  # a recipe auto:BITS is the format search at that budget
RANK_TIMEOUT_S = 300  # a rank's wait on the others in one calibration; a world's, per case


def digest_dir(path: str) -> dict:
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), "rb") as f:
            out[name] = hashlib.file_digest(f, "sha256").hexdigest()
    return out


def shipped_recipes() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(RECIPES_DIR) if f.endswith(".yaml"))


def recipe_file(tmp: str, name: str) -> str:
    """MIXED's recipe `name` written as a recipe file under `tmp`."""
    rules = [{"pattern": p, "format": f} for p, f in MIXED[name].items()] + [{"pattern": "*", "format": "none"}]
    path = os.path.join(tmp, "recipes", f"{name}.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump({"name": name, "quantize": rules, "kv_cache": None}, f)  # JSON is YAML
    return path


def refused(e: EprtError, tmp: str) -> str:
    return "refused: " + str(e).replace(tmp, "TMP")


def calibrate(
    state: ParallelState, ck: str, out: str, recipe: str, algorithm: str, all_experts: bool, tmp: str
) -> str | None:
    """Calibrate `ck` into `out` under `recipe` and `algorithm`, with --calibrate-all-experts where
    `all_experts` (on every rank of `state`): None, or the refusal."""
    search = float(recipe[len(AUTO) :]) if recipe.startswith(AUTO) else None
    try:
        run_ptq(
            state,
            PTQArgs(
                ck,
                None if search else recipe,
                out,
                auto_quantize=search,
                kv_cache="fp8",
                calib_size=6,
                seq_len=24,
                group_tokens=48,
                eval_size=2,
                algorithm=algorithm,
                gptq_min_tokens=1,
                calibrate_all_experts=all_experts,
                progress=False,
            ),
        )
    except EprtError as e:
        return refused(e, tmp)
    return None


def calibrate_on_ranks(jobs: list[tuple], ep: int, tmp: str) -> list[str | None]:
    """`calibrate` of every job on this rank of a world at expert parallelism `ep`."""
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=RANK_TIMEOUT_S)) as state:
        return [calibrate(state, *job, tmp) for job in jobs]


def calibrate_all(jobs: list[tuple], world: int, ep: int, tmp: str) -> list[str | None]:
    """`calibrate` of every job (ck, out, recipe, algorithm, all_experts), in this process or on `world` ranks,
    where every rank must come to the same end."""
    if world == 1:
        return [calibrate(ParallelState.single(), *job, tmp) for job in jobs]
    ranks = run_world(calibrate_on_ranks, world, jobs, ep, tmp, timeout=RANK_TIMEOUT_S * max(1, len(jobs)))
    return [ends[0] if len(set(ends)) == 1 else "ranks disagree: " + " | ".join(map(str, ends)) for ends in zip(*ranks)]


def exported(out: str, tmp: str) -> dict:
    """{export kind: {file: sha256} or "refused: ..."} of calibrated `out`."""
    result = {}
    for kind, kw in EXPORTS.items():
        try:
            result[kind] = digest_dir(export_hf(out, f"{out}-{kind}", progress=False, **kw))
        except EprtError as e:
            result[kind] = refused(e, tmp)
    return result


def case_name(name: str, recipe: str, algorithm: str, all_experts: bool) -> str:
    return f"{name}/{recipe}/{algorithm}" + ("/all-experts" if all_experts else "")


def run_cases(
    ck: str, name: str, cases: list[tuple[str, str]], tmp: str, world: int, ep: int, all_experts: bool
) -> dict:
    """{NAME/RECIPE/ALGORITHM (/all-experts with `all_experts`): its exports' digests, or the
    calibration's refusal} of model `name` at `ck`, for each (recipe, algorithm) of `cases`."""
    outs = [os.path.join(os.path.dirname(ck), f"{recipe}-{algorithm}") for recipe, algorithm in cases]
    jobs = [
        (ck, out, recipe_file(tmp, recipe) if recipe in MIXED else recipe, algorithm, all_experts)
        for out, (recipe, algorithm) in zip(outs, cases)
    ]
    ends = calibrate_all(jobs, world, ep, tmp)
    return {
        case_name(name, recipe, algorithm, all_experts): {"ptq": end} if end else exported(out, tmp)
        for out, (recipe, algorithm), end in zip(outs, cases, ends)
    }


def converted(tmp: str, name: str, family: str, kw: dict, digests: dict) -> str:
    """The eprt checkpoint of tiny model `name`; its round trips' digests go into `digests`."""
    root = os.path.join(tmp, name)
    ck = convert_hf(make_tiny(family, os.path.join(root, "hf"), **kw), os.path.join(root, "ck"), progress=False)
    digests[f"{name}/unquantized"] = digest_dir(export_hf(ck, os.path.join(root, "rt"), progress=False))
    if "source_format" in kw:  # a source stored compressed or in block FP8 decodes
        digests[f"{name}/decoded"] = digest_dir(
            export_hf(ck, os.path.join(root, "rt-bf16"), progress=False, dequantize=True)
        )
    return ck


def wide(family: str) -> dict:
    """make_tiny's keywords of the family's wide tiny model (WIDER), nested configs merged."""
    config = tiny_config(family)
    # a multimodal family's language model (Nemotron-H-Omni's release calls it llm_config)
    key = next((k for k in ("text_config", "llm_config") if k in config), None)
    text = config.get(key)
    sizes = {**WIDE, **WIDER[family]}
    within = text if text is not None else config
    merged = {k: {**within[k], **v} if isinstance(v, dict) else v for k, v in sizes.items()}
    return {key: {**text, **merged}} if text is not None else merged


def all_digests(
    families: list[str],
    recipes: list[str],
    algorithms: list[str],
    world: int = 1,
    ep: int = 1,
    all_experts: bool = False,
) -> dict:
    digests = {}
    models = [(f, f, {}) for f in families] + [s for s in SOURCES if s[1] in families]
    with tempfile.TemporaryDirectory() as tmp:
        for name, family, kw in models:
            start = time.perf_counter()
            ck = converted(tmp, name, family, kw, digests)
            cases = [(r, a) for r in (recipes if name == family else recipes[:1]) for a in algorithms]
            digests.update(run_cases(ck, name, cases, tmp, world, ep, all_experts))
            ptq = lambda r, a: digests[case_name(name, r, a, all_experts)].get("ptq", "")  # noqa: E731
            unfit = [(r, a) for r, a in cases if INPUT_DIM_RULE in ptq(r, a)]
            if name == family and unfit:
                ck = converted(tmp, f"{family}-wide", family, wide(family), digests)
                digests.update(run_cases(ck, f"{family}-wide", unfit, tmp, world, ep, all_experts))
            print(f"{name}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    return digests


def every_rank(case: object, world: int) -> object:
    """`case` with a refusal's "rank 0" (one process) or "ranks 0, ..., N-1" (a world of N) named
    alike: a layout's every rank refuses what one process refuses, and says so."""
    every = "rank 0" if world == 1 else "ranks " + ", ".join(map(str, range(world)))
    return json.loads(json.dumps(case).replace(f"refused: {every} failed", "refused: every rank failed"))


def differences(now: dict, before: dict, world: int = 1) -> list[str]:
    lines = []
    for case in sorted(set(now) | set(before)):
        a, b = now.get(case), before.get(case)
        if every_rank(a, world) != every_rank(b, 1):
            lines.append(f"{case}:\n  before: {json.dumps(b)[:400]}\n  now:    {json.dumps(a)[:400]}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="write the digests here (JSON)")
    p.add_argument("--against", help="compare with digests written before; exit 1 on any difference")
    p.add_argument("--family", action="append", help="only these families (default: all)")
    p.add_argument(
        "--recipe", action="append", help="only these shipped or MIXED recipes, or auto:BITS (default: all but auto)"
    )
    p.add_argument("--algorithm", action="append", choices=ALGORITHMS, help="only these (default: all)")
    p.add_argument("--world", type=int, default=1, help="calibrate on this many CPU processes (default 1)")
    p.add_argument("--ep", type=int, help="their expert parallelism (default: --world)")
    p.add_argument(
        "--calibrate-all-experts",
        action="store_true",
        help="calibrate every case with --calibrate-all-experts (cases NAME/RECIPE/ALGORITHM/all-experts)",
    )
    a = p.parse_args()
    no_wide = sorted(set(a.family or FAMILIES) - set(WIDER))
    if no_wide:
        p.error(f"no wide tiny model in WIDER for {', '.join(no_wide)}: add its sizes there")
    digests = {}
    for family in a.family or list(FAMILIES):  # written after each family: a long run keeps what it did
        digests.update(
            all_digests(
                [family],
                a.recipe or shipped_recipes() + list(MIXED),
                a.algorithm or list(ALGORITHMS),
                a.world,
                a.ep or a.world,
                a.calibrate_all_experts,
            )
        )
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump(digests, f, indent=1, sort_keys=True)
            os.replace(a.out + ".tmp", a.out)
    if a.against:
        with open(a.against) as f:
            before = json.load(f)
        # a subset run compares its own cases, and a case newer than the file is new, not different
        new = sorted(set(digests) - set(before))
        before = {k: v for k, v in before.items() if k in digests}
        diff = differences({k: v for k, v in digests.items() if k in before}, before, a.world)
        print("\n".join(diff) if diff else f"{len(before)} cases: every file the same bytes")
        if new:
            print(f"{len(new)} cases not in {a.against}: {', '.join(new)}")
        return 1 if diff else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
