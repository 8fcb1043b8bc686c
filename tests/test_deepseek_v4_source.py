"""DeepSeek-V4's release as stored: its flat names, its dense Linears FP8 with an E8M0 scale per
128x128 block and its routed experts FP4 (E2M1 two a byte, an E8M0 scale per 32), `M.scale` beside
each `M.weight`. Read exactly (the FP4 experts as compressed-tensors' MXFP4 decompressor reads the
same bytes, the FP8 weights by torch's own E8M0 and E4M3 casts), given back byte for byte, and the
FP4 experts re-encoded to NVFP4 value for value under ModelOpt's closed-form cast's weight_scale_2,
every block kept counted."""

import json
import shutil

import pytest
import torch

from eprt.errors import CheckpointError
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.formats.nvfp4 import dequantize_nvfp4
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.checkpoint import Checkpoint
from eprt.storage.encodings import DEEPSEEK_FP4, DEEPSEEK_FP8, decoder
from eprt.testing.tiny import make_tiny, released
from tests.hf_utils import raw, read_hf_tensors


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    d = tmp_path_factory.mktemp("dsv4")
    hf = make_tiny("deepseek_v4", str(d / "hf"), **released("deepseek_v4"))
    return hf, convert_hf(hf, str(d / "ck"), progress=False)


def test_the_release_is_stored_as_deepseek_stores_it(release):
    hf, ck = release
    source = read_hf_tensors(hf)
    assert source["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert source["layers.1.ffn.experts.0.w1.scale"].dtype == torch.float8_e8m0fnu
    assert source["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert source["layers.1.attn.wq_a.scale"].shape == (1, 1)
    assert source["layers.0.ffn.gate.tid2eid"].dtype == torch.int32
    assert "layers.1.attn.wo_a.scale" not in source and "mtp.0.e_proj.scale" in source
    with Checkpoint(ck) as c:
        encoded = {c.meta(n).encoding for n in c.tensors}
    assert {DEEPSEEK_FP8, DEEPSEEK_FP4} <= encoded


def test_the_attentions_kv_norm_is_named_as_the_release_names_it(release):
    """DeepSeek's inference code (`Attention.kv_norm`), and vLLM reading the release, name every
    attention's kv norm `attn.kv_norm`, the MTP layer's too; transformers' save_pretrained writes
    `attn.norm` (tests/oracles/test_save_pretrained_names.py holds that spelling)."""
    hf, _ = release
    layers = json.load(open(f"{hf}/config.json"))["num_hidden_layers"]
    norms = {n for n in read_hf_tensors(hf) if n.endswith(("attn.kv_norm.weight", "attn.norm.weight"))}
    assert norms == {f"layers.{i}.attn.kv_norm.weight" for i in range(layers)} | {"mtp.0.attn.kv_norm.weight"}


def test_an_unquantized_export_gives_back_every_source_tensor_byte_for_byte(release, tmp_path):
    hf, ck = release
    source = read_hf_tensors(hf)
    out = read_hf_tensors(export_hf(ck, str(tmp_path / "out"), progress=False))
    assert set(out) == set(source)
    for name, t in source.items():
        assert (out[name].dtype, out[name].shape, raw(out[name])) == (t.dtype, t.shape, raw(t)), name


def test_the_fp4_experts_decode_as_compressed_tensors_reads_mxfp4(release):
    pytest.importorskip("compressed_tensors")
    from eprt.storage.encodings import CompressedTensors
    from eprt.testing.tiny import SOURCE_FORMATS

    hf, _ = release
    source = read_hf_tensors(hf)
    mx = SOURCE_FORMATS["mxfp4"]["config_groups"]["group_0"]
    theirs = CompressedTensors("mxfp4-pack-quantized", mx, "test")
    experts = [n[: -len(".weight")] for n in source if ".ffn.experts." in n and n.endswith(".weight")]
    assert experts
    for m in experts:
        w, s = source[f"{m}.weight"], source[f"{m}.scale"]
        ours = decoder(DEEPSEEK_FP4, {}, "test").decode({"weight": w, "scale": s})
        want = theirs.decode({"weight_packed": w.view(torch.uint8), "weight_scale": s.view(torch.uint8)})
        assert ours.dtype == torch.bfloat16 and torch.equal(ours.float(), want.float()), m


def test_the_fp8_weights_decode_by_their_e8m0_block_scales(release):
    hf, _ = release
    source = read_hf_tensors(hf)
    dense = [n[: -len(".scale")] for n in source if n.endswith(".scale") and ".ffn.experts." not in n]
    assert dense
    for m in dense:
        w, s = source[f"{m}.weight"], source[f"{m}.scale"]
        rows, cols = w.shape
        per_element = s.float().repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        want = (w.float() * per_element).bfloat16()
        assert torch.equal(decoder(DEEPSEEK_FP8, {}, "test").decode({"weight": w, "scale": s}), want), m


def test_the_fp4_experts_in_nvfp4_are_modelopts_lossless_cast(release, tmp_path):
    shard_cast = pytest.importorskip("modelopt.torch.export.shard_cast_utils")
    hf, ck = release
    run_ptq(
        ParallelState.single(),
        PTQArgs(ck, "nvfp4_experts_only", str(tmp_path / "q"), calib_size=4, seq_len=16, eval_size=0),
    )
    out = export_hf(str(tmp_path / "q"), str(tmp_path / "out"), progress=False)
    assert check_export(out, hf) == []  # against the source: its FP8 modules left unquantized come decoded
    source, ours = read_hf_tensors(hf), read_hf_tensors(out)
    experts = sorted(
        n[: -len(".weight")]
        for n in source
        if n.startswith("layers.") and ".ffn.experts." in n and n.endswith(".weight")
    )
    assert experts and "mtp.0.ffn.experts.0.w1.weight" in ours  # the MTP layer travels, unquantized
    for m in experts:
        packed = source[f"{m}.weight"].view(torch.uint8)
        gate_up = [m[:-2] + w for w in ("w1", "w3")] if m[-2:] in ("w1", "w3") else [m]
        k_max = max(shard_cast.mxfp4_kmax(source[f"{g}.scale"]) for g in gate_up)  # gate and up share one
        theirs = shard_cast.quantize_mxfp4_to_nvfp4_lossless(
            packed, source[f"{m}.scale"].view(torch.uint8), k_max, "cpu"
        )
        # the same weight_scale_2 and values; a block whose largest code is under 4 may take half
        # the source's scale here (codes doubled), as exact
        assert raw(theirs[2]) == raw(ours[f"{m}.weight_scale_2"]) and theirs[3] == theirs[4], m
        decoded = decoder(DEEPSEEK_FP4, {}, "test").decode(
            {"weight": source[f"{m}.weight"], "scale": source[f"{m}.scale"]}
        )
        nvfp4 = dequantize_nvfp4(ours[f"{m}.weight"], ours[f"{m}.weight_scale"], ours[f"{m}.weight_scale_2"])
        assert torch.equal(nvfp4.float(), decoded.float()), m
        assert torch.equal(dequantize_nvfp4(*theirs[:3]).float(), decoded.float()), m
    record = json.loads((tmp_path / "q" / "eprt.json").read_text())["quantization"]["calibration"]
    blocks = sum(source[f"{m}.scale"].numel() for m in experts)
    assert record["mxfp4_reencoded"] == {"experts_tensors": 8, "blocks": blocks, "kept": blocks}


def test_weights_stored_with_a_scale_under_a_config_that_declares_none_are_refused_by_name(release, tmp_path):
    hf, _ = release
    bare = tmp_path / "bare"
    shutil.copytree(hf, bare)
    config = json.loads((bare / "config.json").read_text())
    del config["quantization_config"]
    (bare / "config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"with its scale '.*\.scale', but config.json declares no FP8"):
        convert_hf(str(bare), str(tmp_path / "ck"), progress=False)
