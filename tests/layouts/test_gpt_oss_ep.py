"""GPT-OSS under expert parallelism (which ModelOpt does not run: its experts are stored transposed and
interleaved): every rank's logits are bitwise the single-process logits of its batch, over more tokens
than a sliding window; FP8 and NVFP4 exports are the same bytes at every (world, ep), pass eprt-check
against the source, keep the router and the sinks as the source held them, and write each routed expert
per expert, its weights quantized and its biases (gate and up apart, out of the interleaved source) in
the source's dtype beside them."""

import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save_file

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.testing.tiny import make_tiny, released
from tests.ep_checks import assert_ep_logits, assert_family_exports, tiny_checkpoints
from tests.hf_utils import raw, read_hf_tensors

FAMILY = "gpt_oss"
L = "model.layers"
E = 8
# ModelOpt's tensors of each quantized Linear, by recipe
QUANTIZED_LEAVES = {
    "fp8": ("weight", "weight_scale", "input_scale"),
    "nvfp4": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
}
# vLLM builds the router unquantized; the attention's Linears and every routed expert are quantized
NEVER_QUANTIZED = [f"{L}.0.mlp.router", f"{L}.1.mlp.router"]
QUANTIZED = [
    f"{L}.0.self_attn.q_proj",
    f"{L}.1.self_attn.o_proj",
    f"{L}.0.mlp.experts.0.gate_proj",
    f"{L}.1.mlp.experts.7.down_proj",
]


def as_is(name: str) -> bool:
    """The sinks, the router and the attention's output bias travel in the source's dtype and bytes."""
    return name.endswith((".self_attn.sinks", ".mlp.router.weight", ".mlp.router.bias", ".self_attn.o_proj.bias"))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp(FAMILY), FAMILY)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_are_bitwise_the_single_process_logits(ckpts, world, ep):
    assert_ep_logits([ckpts["fp32"][1]], world, ep, seq_len=12)  # windows of 4: three of them


@pytest.mark.timeout(200)
def test_the_mxfp4_release_under_expert_parallelism(tmp_path):
    """The release's MXFP4 experts, each rank decoding only its own rows: the single-process logits."""
    hf = make_tiny(FAMILY, str(tmp_path / "hf"), dtype="fp32", **released(FAMILY))
    assert_ep_logits([convert_hf(hf, str(tmp_path / "ck"), progress=False)], 2, 2, seq_len=12)


def predicted_names(source: dict[str, torch.Tensor], recipe: str) -> set[str]:
    """Every tensor of a quantized export of the tiny model: each Linear of the attention and every
    routed expert's projection quantized (with its KV scales under NVFP4's fp8 KV cache), the rest
    (norms, sinks, router, embeddings, head) as the source names them, the experts per expert."""
    out = set()
    for name in source:
        prefix, _, leaf = name.rpartition(".")
        if leaf in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
            for e in range(E):
                pieces = ("gate_proj", "up_proj") if leaf.startswith("gate_up") else ("down_proj",)
                for p in pieces:
                    if leaf.endswith("_bias"):
                        out.add(f"{prefix}.{e}.{p}.bias")
                    else:
                        out |= {f"{prefix}.{e}.{p}.{q}" for q in QUANTIZED_LEAVES[recipe]}
        elif ".self_attn." in name and leaf == "weight":
            out |= {f"{prefix}.{q}" for q in QUANTIZED_LEAVES[recipe]}
        else:
            out.add(name)
    if recipe == "nvfp4":  # calibrated with an fp8 KV cache
        out |= {f"{L}.{i}.self_attn.{k}_proj.{k}_scale" for i in range(2) for k in "kv"}
    return out


@pytest.mark.timeout(400)
def test_exports_are_the_same_bytes_at_every_layout(ckpts, tmp_path):
    for _, recipe, source, exported, ref in assert_family_exports(
        {FAMILY: ckpts}, str(tmp_path), {FAMILY: NEVER_QUANTIZED}, {FAMILY: QUANTIZED}, as_is
    ):
        assert set(exported) == predicted_names(source, recipe), recipe
        for i in range(2):
            p = f"{L}.{i}.mlp.experts"
            gate_up_bias, down_bias = source[f"{p}.gate_up_proj_bias"], source[f"{p}.down_proj_bias"]
            for e in range(E):
                # gate at the even columns of the interleaved source, up at the odd
                for got, want in (
                    (exported[f"{p}.{e}.gate_proj.bias"], gate_up_bias[e, 0::2]),
                    (exported[f"{p}.{e}.up_proj.bias"], gate_up_bias[e, 1::2]),
                    (exported[f"{p}.{e}.down_proj.bias"], down_bias[e]),
                ):
                    assert got.dtype == want.dtype and raw(got) == raw(want.contiguous()), (p, e)
        excluded = json.load(open(os.path.join(ref, "hf_quant_config.json")))["quantization"]["exclude_modules"]
        # vLLM builds the router without a quantization config, and eprt-check says so of a quantized one
        assert excluded == ["lm_head", "model.embed_tokens", f"{L}.0.mlp.router", f"{L}.1.mlp.router"]
        if recipe == "fp8":
            hf = ckpts["bf16"][0]
            assert any(
                p.startswith(f"{L}.1.mlp.router.weight: quantized, but") for p in with_fp8_router(ref, hf, tmp_path)
            )


def with_fp8_router(export: str, hf: str, tmp_path) -> list[str]:
    """eprt-check's problems with a copy of `export` whose layer-1 router is stored in FP8 with its scales."""
    forged = tmp_path / "forged"
    shutil.copytree(export, forged)
    tensors = read_hf_tensors(str(forged))
    router = f"{L}.1.mlp.router"
    tensors[f"{router}.weight"] = tensors[f"{router}.weight"].to(torch.float8_e4m3fn)
    tensors[f"{router}.weight_scale"], tensors[f"{router}.input_scale"] = torch.tensor(1.0), torch.tensor(1.0)
    files = [f for f in os.listdir(forged) if f.endswith(".safetensors")]
    for f in files:
        os.remove(forged / f)
    save_file(tensors, str(forged / files[0]))
    index = forged / "model.safetensors.index.json"
    if index.exists():
        m = json.loads(index.read_text())
        m["weight_map"] = {n: files[0] for n in tensors}
        index.write_text(json.dumps(m))
    return check_export(str(forged), hf)
