"""DeepSeek-V4 under expert parallelism: every rank's logits are bitwise the single-process logits of
its batch (the hash-routed layers reading each rank's own token ids), over more tokens than the
sliding window and a CSA window; FP8 and NVFP4 exports are the same bytes at every (world, ep) and
pass eprt-check against the source, in the release's names."""

import pytest

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.testing.tiny import make_tiny, released
from tests.ep_checks import (
    LAYOUTS,
    RECIPES,
    assert_ep_logits,
    calibrate_every_layout,
    exports_by_layout,
    same_files,
    tiny_checkpoints,
)
from tests.hf_utils import read_hf_tensors

FAMILY = "deepseek_v4"


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp(FAMILY), FAMILY)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_are_bitwise_the_single_process_logits(ckpts, world, ep):
    assert_ep_logits([ckpts["fp32"][1]], world, ep, seq_len=18)  # a window of 8, CSA entries of 4, HCA of 8


@pytest.mark.timeout(400)
def test_exports_are_the_same_bytes_at_every_layout(ckpts, tmp_path):
    out = str(tmp_path)
    hf, ck = ckpts["bf16"]
    calibrate_every_layout({FAMILY: ck}, out, calib_size=6)
    source = set(read_hf_tensors(hf))
    for recipe, *_ in RECIPES:
        exports = exports_by_layout(out, FAMILY, recipe)
        ref = exports["w1-ep1"]
        assert check_export(ref, hf) == []
        for layout in LAYOUTS:
            assert same_files(ref, exports[layout]), (recipe, layout)
        exported = set(read_hf_tensors(ref))
        assert "layers.1.attn.wq_a.weight_scale" in exported and "layers.0.ffn.gate.tid2eid" in exported
        assert {n for n in source if not n.startswith("layers.")} <= exported  # embed, head, norm, hc_head_*, mtp


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
