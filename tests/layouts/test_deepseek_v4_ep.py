"""DeepSeek-V4 under expert parallelism: every rank's logits are bitwise the single-process logits of
its batch (the hash-routed layers reading each rank's own token ids), over more tokens than the
sliding window and a CSA window; FP8 and NVFP4 exports are the same bytes at every (world, ep) and
pass eprt-check against the source, in the release's names, with what the engines build unquantized
left as the source holds it (tests/ep_checks.assert_family_exports); the recipe that quantizes the
MTP layer exports the same bytes at (2, ep 2)."""

import pytest
import torch

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.testing.tiny import make_tiny, released
from tests.ep_checks import (
    LAYOUTS,
    assert_ep_logits,
    assert_family_exports,
    calibrate,
    calibrate_every_layout,
    exports_by_layout,
    same_files,
    tiny_checkpoints,
)
from tests.hf_utils import read_hf_tensors
from tests.multiproc import free_port, run_world

FAMILY = "deepseek_v4"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return {FAMILY: tiny_checkpoints(tmp_path_factory.mktemp(FAMILY), FAMILY)}


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_are_bitwise_the_single_process_logits(ckpts, world, ep):
    assert_ep_logits([ckpts[FAMILY]["fp32"][1]], world, ep, seq_len=18)  # a window of 8, CSA entries of 4, HCA of 8


# what the engines build unquantized: the embedding and head, the routers, the grouped output
# projection's first half, the compressors' and the indexer's head weights; and what they quantize
NEVER_QUANTIZED = {
    FAMILY: [
        "embed",
        "head",
        "layers.0.ffn.gate",
        "layers.3.attn.wo_a",
        "layers.1.attn.compressor.wgate",
        "layers.3.attn.indexer.weights_proj",
    ]
}
QUANTIZED = {
    FAMILY: [
        "layers.1.attn.wq_a",
        "layers.0.attn.wo_b",
        "layers.3.attn.indexer.wq_b",
        "layers.2.ffn.shared_experts.w2",
        "layers.1.ffn.experts.7.w3",
    ]
}


def as_released(name: str) -> bool:
    """What travels as the source holds it: the fp32 router bias, tid2eid, sinks, compressors' position
    biases and hyper-connections, and the MTP layer (no recipe here says mtp: true)."""
    released = name.endswith(("ffn.gate.bias", "tid2eid", "attn_sink", ".ape")) or ".hc_" in name
    return released or name.startswith(("hc_head", "mtp."))


@pytest.mark.timeout(400)
def test_exports_are_the_same_bytes_at_every_layout(ckpts, tmp_path):
    for _, _, source, exported, _ in assert_family_exports(
        ckpts, str(tmp_path), NEVER_QUANTIZED, QUANTIZED, as_released
    ):
        hyper = [n for n in source if n.startswith("layers.") and ".hc_" in n]  # the release's fp32
        assert hyper and all(exported[n].dtype == source[n].dtype == torch.float32 for n in hyper)
        assert any(n.startswith("mtp.0.ffn.experts.") for n in exported)


@pytest.mark.timeout(400)
def test_the_mtp_recipe_exports_the_same_bytes_at_world_2_ep_2(ckpts, tmp_path):
    """The MTP layer runs on each rank's own sequences (their streams and next tokens) with its own
    experts: the export of a recipe that quantizes it is the single process's, byte for byte."""
    cks, out, recipes = (
        {FAMILY: ckpts[FAMILY]["bf16"][1]},
        str(tmp_path),
        [("nvfp4_experts_fp8_attention_mtp", None, "bf16")],
    )
    calibrate(cks, out, 1, free_port(), recipes, calib_size=6)
    run_world(calibrate, 2, cks, out, 2, free_port(), recipes, 6, timeout=240)
    one, two = (
        export_hf(f"{out}/{FAMILY}-{recipes[0][0]}-{layout}", f"{out}/export-{layout}", progress=False)
        for layout in ("w1-ep1", "w2-ep2")
    )
    assert same_files(one, two)
    assert any(n.startswith("mtp.0.ffn.experts.") and n.endswith(".input_scale") for n in read_hf_tensors(one))


@pytest.mark.timeout(400)
def test_the_releases_fp8_and_fp4_source_exports_the_same_bytes_at_every_layout(tmp_path):
    """Each rank reads its experts' FP4 codes and E8M0 scales alone: the NVFP4 export of the encoded
    source is the same bytes at (2, ep 2) and (4, ep 2) as in one process."""
    hf = make_tiny(FAMILY, str(tmp_path / "hf"), **released(FAMILY))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    out = str(tmp_path / "out")
    calibrate_every_layout({"release": ck}, out, recipes=[("nvfp4", None, "bf16")], calib_size=6)
    exports = exports_by_layout(out, "release", "nvfp4")
    assert check_export(exports["w1-ep1"], hf) == []
    for layout in LAYOUTS:
        assert same_files(exports["w1-ep1"], exports[layout]), layout
