"""A quantized export holds exactly the source's tensors, each quantized Linear's weight replaced by
its ModelOpt companions, plus the KV-cache scales: for every family and recipe.

The expected set is predicted here from the source's tensor names, its config and the recipe's
patterns (eprt/configs/ptq/*.yaml), with the modules the engines build unquantized written out, not
taken from the exporter.
"""

import fnmatch
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.hf.quant_configs import summarize_excluded
from eprt.parallel import ParallelState
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.hf_utils import read_hf_tensors

FAMILIES = [
    "qwen3_moe",
    "deepseek_v3",
    "kimi_linear",
    "kimi_k3",
    "kimi_k25",
    "kimi_vl",
    "glm4_moe",
    "deepseek_v32",
    "glm_moe_dsa",
    "qwen3_next",
    "qwen3_5_moe",
    "qwen3_5_moe_text",
    "mistral4",
    "minimax_m2",
    "minimax_m3_vl",
    "minimax_m3_vl_text",
    "nemotron_h",
    "nemotron_h_omni",
    "deepseek_v4",
]
# each shipped one-format recipe once, with and without an FP8 KV cache among them: the KV scales on quantized
# attention (fp8), on attention left unquantized (nvfp4_experts_only), and none (nvfp4)
RECIPES_AND_KV = [("fp8", "fp8"), ("nvfp4", None), ("nvfp4_experts_only", "fp8")]
MIXED_RECIPES = ["nvfp4_experts_fp8_attention", "kimi_k3_release"]  # calibrated with an FP8 KV cache only
ROOT = Path(__file__).resolve().parents[1]
RECIPE_DIR = ROOT / "eprt" / "configs" / "ptq"
TOOL = ROOT / "tools" / "check_export.py"
COMPANIONS = {
    "fp8": ("weight", "weight_scale", "input_scale"),
    "nvfp4": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
}
# What the engines build unquantized whatever the recipe: embeddings, lm_head, MoE routers, Kimi's
# latent expert projections and attention-residual queries, the vision towers and projector,
# DeepSeek-V3.2's lightning indexer (vLLM fuses its wk and weights_proj into one unquantized Linear),
# Qwen3-Next's and Qwen3.5's shared-expert gate and linear-attention b/a projections (vLLM merges
# them into in_proj_ba, unquantized), a multi-token-prediction layer's eh_proj (a plain torch Linear in
# vLLM and SGLang) and shared head (an lm head), MiniMax-M3's block-sparse indexer (it only chooses
# key blocks) and its projectors, Nemotron-H's router (mixer.gate), embeddings and the MTP layers it
# carries through (DeepSeek-V4's `mtp.K`, which eprt runs, are MTP layers as DeepSeek-V3's), Nemotron-H-Omni's vision and sound towers and projectors, DeepSeek-V4's embedding
# and head (`embed`, `head`), router (ffn.gate), grouped output projection's first half (wo_a, an einsum
# in the engines), compressors' projections and indexer's head weights.
NEVER_QUANTIZED = re.compile(
    r"(.*embed_tokens|.*lm_head|.*\.mlp\.gate|.*\.block_sparse_moe\.gate"
    r"|.*\.routed_expert_(down|up)_proj|.*_res_proj|vision_tower\..*|(mm|multi_modal)_projector\..*"
    r"|.*\.self_attn\.indexer\.(wq_b|wk|weights_proj)"
    r"|.*\.mlp\.shared_expert_gate|.*\.linear_attn\.in_proj_(ba|b|a)|model\.visual\..*"
    r"|.*\.self_attn\.(index_|indexer\.)(q|k)_proj|multi_modal_projector\..*|patch_merge_mlp\..*"
    r"|.*\.eh_proj|.*\.shared_head\.head|.*\.mixer\.gate|.*backbone\.embeddings|(language_model\.)?mtp\.(?!\d+\.).*"
    r"|(vision_model|mlp1|vision_projector|sound_encoder|sound_projection)\..*"
    r"|embed|head|.*\.ffn\.gate|.*\.attn\.wo_a|.*\.compressor\.(wkv|wgate)|.*\.indexer\.weights_proj)"
)
EXPERT = re.compile(r"(.*\.experts)\.\d+\.[^.]+")


def source_names(hf_dir: str) -> dict[str, tuple[int, ...]]:
    return {n: tuple(t.shape) for n, t in read_hf_tensors(hf_dir).items()}


def text_layers(hf_dir: str) -> int:
    config = json.loads(Path(hf_dir, "config.json").read_text())
    text = config.get("text_config") or config.get("llm_config") or config  # a VLM's language model
    return len(text["hybrid_override_pattern"]) if "hybrid_override_pattern" in text else text["num_hidden_layers"]


def predicted_names(hf_dir: str, recipe: str, kv: bool) -> set[str]:
    spec = yaml.safe_load((RECIPE_DIR / f"{recipe}.yaml").read_text())
    rules, mtp = spec["quantize"], spec.get("mtp", False)  # mtp: the rules quantize the MTP layers too
    layers = text_layers(hf_dir)
    sources = source_names(hf_dir)
    out = set()
    for name, shape in sources.items():
        module, _, leaf = name.rpartition(".")
        layer = re.search(r"layers\.(\d+)\.", name)
        # DeepSeek's MTP layers: V3's past the decoder layers, V4's `mtp.K`
        in_mtp = layer is not None and int(layer.group(1)) >= layers or re.match(r"mtp\.\d+\.", name) is not None
        carried = in_mtp and not mtp
        expert = EXPERT.fullmatch(module)
        as_recipe_sees = expert.group(1) if expert else module
        # Nemotron-H's attention (a layer's mixer q/k/v/o) answers to the recipes' `self_attn` too, and
        # DeepSeek-V4's (a layer's attn) where vLLM builds a quantizable Linear: wq_a, wkv, wq_b, wo_b, the indexer's wq_b
        also = re.sub(r"\.mixer\.([qkvo]_proj)$", r".self_attn.\1", as_recipe_sees)
        also = re.sub(r"\.attn\.(wq_a|wkv|wq_b|wo_b|indexer\.wq_b)$", r".self_attn.\1", also)
        chosen = next(
            (r["format"] for r in rules if any(fnmatch.fnmatchcase(n, r["pattern"]) for n in (as_recipe_sees, also))),
            "none",
        )
        if (
            leaf == "weight"
            and len(shape) == 2
            and not carried
            and not NEVER_QUANTIZED.fullmatch(module)
            and chosen != "none"
        ):
            out |= {f"{module}.{c}" for c in COMPANIONS[chosen]}
        else:
            out.add(name)
    if kv:
        # attentions with a KV cache: softmax attention (q/k/v or MLA), not Kimi's delta attention (A_log)
        # (Nemotron-H's attention is a layer's `mixer`; its carried MTP layers have none)
        found = (re.match(r"(.*\.(self_attn|mixer))\.(k_proj|kv_a_proj_with_mqa)\.", n) for n in sources)
        attns = {m.group(1) for m in found if m and "mtp." not in m.group(1)}
        attns -= {n.rsplit(".", 1)[0] for n in sources if n.endswith(".A_log")}
        attns = {a for a in attns if int(re.search(r"layers\.(\d+)\.", a).group(1)) < layers or mtp}
        out |= {f"{a}.k_proj.k_scale" for a in attns} | {f"{a}.v_proj.v_scale" for a in attns}
    return out


def exported_names(out: str) -> set[str]:
    return set(json.loads(Path(out, "model.safetensors.index.json").read_text())["weight_map"])


def exported_files(out: str) -> set[str]:
    return {p.name for p in Path(out).iterdir()}


def predicted_files(hf_dir: str, out: str) -> set[str]:
    """The source's files but its weights (a tiny source holds only files serving reads), the export's
    shards and index, ModelOpt's hf_quant_config.json, its model card and the PTQ quality report with
    its page (files no engine reads)."""
    source = {
        p.name
        for p in Path(hf_dir).iterdir()
        if not p.name.startswith("model.safetensors") and not re.fullmatch(r"model-\d+-of-\d+\.safetensors", p.name)
    }
    shards = set(json.loads(Path(out, "model.safetensors.index.json").read_text())["weight_map"].values())
    return (
        source
        | shards
        | {
            "model.safetensors.index.json",
            "hf_quant_config.json",
            "README.md",
            "eprt_quality.json",
            "eprt_quality.html",
        }
    )


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("names")
    out = {}
    for family in FAMILIES:
        hf = make_tiny(family, str(d / family / "hf"))
        out[family] = (hf, convert_hf(hf, str(d / family / "ck"), progress=False))
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_the_export_holds_exactly_the_predicted_tensors(sources, family, tmp_path):
    hf, ck = sources[family]
    state = ParallelState.single()
    for recipe, kv in RECIPES_AND_KV + [(r, "fp8") for r in MIXED_RECIPES]:
        q = str(tmp_path / f"{recipe}-{kv}")
        run_ptq(state, PTQArgs(ck, recipe, q, kv_cache=kv, calib_size=2, seq_len=16, eval_size=2, progress=False))
        out = export_hf(q, q + "-hf", progress=False)
        got, want = exported_names(out), predicted_names(hf, recipe, kv is not None)
        assert got == want, (recipe, kv, sorted(got - want), sorted(want - got))
        assert exported_files(out) == predicted_files(hf, out)
        assert check_export(out, hf) == []


@pytest.mark.parametrize(
    "family, kv, layer",
    [
        ("deepseek_v3", None, "model.layers.3."),
        ("deepseek_v3", "fp8", "model.layers.3."),
        ("glm4_moe", "fp8", "model.layers.3."),
        ("deepseek_v4", None, "mtp.0."),
    ],
)
def test_the_mtp_recipe_also_quantizes_the_mtp_layer(sources, family, kv, layer, tmp_path):
    """nvfp4_experts_fp8_attention_mtp (mtp: true): DeepSeek-V3's, GLM-4.5's and DeepSeek-V4's MTP
    layer as the decoder's layers, its KV scales with an FP8 KV cache."""
    hf, ck = sources[family]
    q = str(tmp_path / "q")
    run_ptq(
        ParallelState.single(),
        PTQArgs(ck, "nvfp4_experts_fp8_attention_mtp", q, kv_cache=kv, calib_size=2, seq_len=16, progress=False),
    )
    out = export_hf(q, q + "-hf", progress=False)
    got, want = exported_names(out), predicted_names(hf, "nvfp4_experts_fp8_attention_mtp", kv is not None)
    assert got == want, (kv, sorted(got - want), sorted(want - got))
    assert {n for n in want if n.startswith(layer) and n.endswith("_scale")}  # the MTP layer's
    assert check_export(out, hf) == []


def test_experts_held_fused_are_exported_per_expert(sources, tmp_path):
    """Qwen3.5-MoE as released holds each layer's experts fused (experts.gate_up_proj, down_proj);
    the engines' Qwen3.5 loaders read quantized experts per expert (experts.E.gate_proj.weight
    and its scales), so the export is that of the same model stored per expert."""
    per_expert_hf, _ = sources["qwen3_5_moe_text"]
    hf = make_tiny("qwen3_5_moe_text", str(tmp_path / "hf"), fused_experts=True)
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, "nvfp4", q, kv_cache="fp8", calib_size=2, seq_len=16, progress=False))
    out = export_hf(q, q + "-hf", progress=False)
    assert exported_names(out) == predicted_names(per_expert_hf, "nvfp4", True)
    assert check_export(out, hf) == []


@pytest.fixture(scope="module")
def export(sources, tmp_path_factory):
    hf, ck = sources["qwen3_moe"]
    q = str(tmp_path_factory.mktemp("q") / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, "nvfp4", q, kv_cache="fp8", calib_size=2, seq_len=16, progress=False))
    return hf, export_hf(q, q + "-hf", progress=False)


def add_tensor(out: str, name: str, t) -> None:
    """Put one more tensor into the export's first shard, and into its index."""
    index_path = Path(out, "model.safetensors.index.json")
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    tensors = load_file(Path(out, shard))
    tensors[name] = t
    save_file(tensors, Path(out, shard))
    index["weight_map"][name] = shard
    index_path.write_text(json.dumps(index))


@pytest.mark.parametrize(
    "name, dtype",
    [
        ("model.layers.0.self_attn.k_amax", "float32"),
        ("model.layers.1.mlp.experts.tokens", "int64"),
        ("model.layers.0.mlp.extra.weight", "bfloat16"),
    ],
)
def test_a_foreign_tensor_is_refused_by_name(export, tmp_path, name, dtype):
    hf, out = export
    bad = shutil.copytree(out, tmp_path / "bad")
    add_tensor(str(bad), name, torch.ones(4, dtype=getattr(torch, dtype)))
    for source in (None, hf):  # from the export's own config, and against the source
        problems = check_export(bad, source)
        assert len(problems) == 1 and problems[0].startswith(f"{name}:"), problems


def test_a_missing_source_tensor_is_refused_against_the_source(export, tmp_path):
    hf, out = export
    bad = shutil.copytree(out, tmp_path / "bad")
    index_path = bad / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = index["weight_map"].pop("model.norm.weight")
    tensors = load_file(bad / shard)
    del tensors["model.norm.weight"]
    save_file(tensors, bad / shard)
    index_path.write_text(json.dumps(index))
    assert check_export(bad) == []  # nothing foreign
    assert check_export(bad, hf) == ["model.norm.weight: a source tensor missing from the export"]


def test_the_tool_checks_against_the_source(export, tmp_path):
    hf, out = export
    bad = shutil.copytree(out, tmp_path / "bad")
    add_tensor(str(bad), "model.layers.0.mlp.extra.weight", torch.ones(4, dtype=torch.bfloat16))
    for d, rc in ((out, 0), (bad, 1)):
        r = subprocess.run(
            [sys.executable, str(TOOL), str(d), "--source", hf], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == rc, r.stdout + r.stderr
    assert r.stdout.splitlines()[0].startswith("model.layers.0.mlp.extra.weight: not a source tensor")


def test_excluded_wildcards_never_cover_a_quantized_module():
    # layer 1 stays unquantized beside layers 10 and 11: `model.layers.1*` would cover them
    linears = ("self_attn.q_proj", "mlp.down_proj")
    quantized = {f"model.layers.{i}.{m}" for i in (0, 10, 11) for m in linears}
    unquantized = {f"model.layers.1.{m}" for m in linears} | {"lm_head", "model.layers.0.mlp.gate"}
    assert summarize_excluded(unquantized, quantized) == {"model.layers.1.*", "lm_head", "model.layers.0.mlp.gate"}
    # with no layer 1x, the whole layer is one prefix wildcard, as ModelOpt writes it
    assert summarize_excluded(unquantized, quantized - {m for m in quantized if ".1" in m}) == {
        "model.layers.1*",
        "lm_head",
        "model.layers.0.mlp.gate",
    }
