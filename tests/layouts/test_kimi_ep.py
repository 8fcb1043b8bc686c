"""Kimi-K3 expert parallel: every rank's logits are bitwise the single-process logits of its batch, and a
PTQ export is the same bytes at every (world, ep), with K3's never-quantized modules excluded and
left in the source dtype."""

import json
import os

import pytest
import torch

from eprt.hf.check_export import check_export
from tests.ep_checks import (
    LAYOUTS,
    assert_ep_logits,
    calibrate_every_layout,
    exports_by_layout,
    same_files,
    tiny_checkpoints,
)
from tests.hf_utils import raw, read_hf_tensors

# nvfp4 with an FP8 KV cache, calibrated in bf16
RECIPES = [("nvfp4", "fp8", "bf16")]


@pytest.fixture(scope="module")
def k3(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp("k3"), "kimi_k3")


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_k3_expert_parallel_logits(k3, world, ep):
    assert_ep_logits([k3["fp32"][1]], world, ep)


@pytest.mark.timeout(300)
def test_k3_ptq_export_is_the_same_bytes_at_every_layout(k3, tmp_path):
    hf, ck = k3["bf16"]
    out = str(tmp_path)
    calibrate_every_layout({"k3": ck}, out, RECIPES, calib_size=6)
    exports = exports_by_layout(out, "k3", "nvfp4")
    ref = exports["w1-ep1"]
    assert check_export(ref) == []
    for layout in LAYOUTS:
        assert same_files(ref, exports[layout]), layout

    excluded = json.load(open(os.path.join(ref, "hf_quant_config.json")))["quantization"]["exclude_modules"]
    lm = "language_model.model.layers"
    never_quantized = [
        f"{lm}.1.block_sparse_moe.routed_expert_down_proj",
        f"{lm}.1.block_sparse_moe.routed_expert_up_proj",
        f"{lm}.0.self_attention_res_proj",
        f"{lm}.3.mlp_res_proj",
        "language_model.model.output_attn_res_proj",
    ]
    assert set(never_quantized) | {"vision_tower.*", "mm_projector.*"} <= set(excluded)
    source, exported = read_hf_tensors(hf), read_hf_tensors(ref)
    for module in never_quantized:
        assert raw(exported[f"{module}.weight"]) == raw(source[f"{module}.weight"]), module
        assert exported[f"{module}.weight"].dtype == torch.bfloat16
        assert f"{module}.weight_scale" not in exported and f"{module}.input_scale" not in exported
    vision = [n for n in source if n.startswith(("vision_tower.", "mm_projector."))]
    assert vision and all(exported[n].dtype == source[n].dtype and raw(exported[n]) == raw(source[n]) for n in vision)
    # KV-cache scales on the MLA layer (2) only: KDA layers keep a recurrent state, not a KV cache
    kv = sorted(n for n in exported if n.endswith(("k_scale", "v_scale")))
    assert kv == [f"{lm}.2.self_attn.k_proj.k_scale", f"{lm}.2.self_attn.v_proj.v_scale"]
    # the routed experts keep Kimi's names, quantized
    assert exported[f"{lm}.1.block_sparse_moe.experts.0.w1.weight"].dtype == torch.uint8
    assert f"{lm}.1.block_sparse_moe.experts.7.w2.weight_scale_2" in exported


@pytest.mark.timeout(300)
def test_kimi_vl_ptq_export_is_the_same_bytes_at_every_layout(tmp_path_factory, tmp_path):
    """Kimi-VL (Kimi-K2.5's language model, its own MoonViT tower and projector names): the same bytes at
    every (world, ep), the tower and the projector excluded and exported as the source held them."""
    hf, ck = tiny_checkpoints(tmp_path_factory.mktemp("kimi_vl"), "kimi_vl")["bf16"]
    out = str(tmp_path)
    calibrate_every_layout({"kimi_vl": ck}, out, RECIPES, calib_size=6)
    exports = exports_by_layout(out, "kimi_vl", "nvfp4")
    ref = exports["w1-ep1"]
    assert check_export(ref, hf) == []
    for layout in LAYOUTS:
        assert same_files(ref, exports[layout]), layout
    excluded = json.load(open(os.path.join(ref, "hf_quant_config.json")))["quantization"]["exclude_modules"]
    assert {"vision_tower.*", "multi_modal_projector.*"} <= set(excluded)
    source, exported = read_hf_tensors(hf), read_hf_tensors(ref)
    carried = [n for n in source if n.startswith(("vision_tower.", "multi_modal_projector."))]
    assert len(carried) == 12
    for name in carried:
        assert raw(exported[name]) == raw(source[name]), name
    assert exported["language_model.model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.uint8
