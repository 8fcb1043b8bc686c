"""GPT-OSS's release: its routed experts' weights in OpenAI's MXFP4 (`gate_up_proj_blocks`/`_scales`,
quant_method mxfp4), fused and interleaved. eprt decodes them as transformers' Mxfp4 dequantization
does (the same logits), keeps them encoded in eprt's order so that each rank reads only its experts'
rows, writes them back byte for byte, and re-encodes them to NVFP4 as ModelOpt's lossless cast does."""

import filecmp
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import save

import eprt
from eprt.errors import CheckpointError, ConfigError
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel.state import ParallelState
from eprt.quant.formats.nvfp4 import dequantize_nvfp4
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.checkpoint import Checkpoint
from eprt.storage.encodings import source_quantization
from eprt.storage.mxfp4_blocks import MXFP4_BLOCKS, decode_mxfp4_blocks
from eprt.testing.tiny import make_tiny, released, tiny_config
from tests.hf_utils import raw, read_hf_tensors

FAMILY, E, LAYERS = "gpt_oss", 8, 2
EXPERTS = [f"model.layers.{i}.mlp.experts" for i in range(LAYERS)]


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """(release dir, its eprt checkpoint): the tiny model as GPT-OSS is released, the rest in fp32."""
    d = tmp_path_factory.mktemp("gpt_oss_mxfp4")
    hf = make_tiny(FAMILY, str(d / "hf"), dtype="fp32", **released(FAMILY))
    return hf, convert_hf(hf, str(d / "ck"), progress=False)


def test_the_decoder_is_transformers_dequantization():
    """Every code (both nibbles) and a span of scales, as transformers' Mxfp4 integration decodes them."""
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 6, 4, 16), generator=g, dtype=torch.uint8)
    scales = torch.randint(100, 150, (3, 6, 4), generator=g, dtype=torch.uint8)
    want = mxfp4.convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, in, out], as it holds them
    got = decode_mxfp4_blocks(blocks, scales)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want.transpose(1, 2))


def test_logits_equal_transformers_reading_the_release(release):
    transformers = pytest.importorskip("transformers")
    hf, ck = release
    theirs = transformers.GptOssForCausalLM.from_pretrained(
        hf, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    ).eval()
    ids = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = theirs(ids).logits, eprt.load_model(ck, dtype=torch.float32)(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_the_experts_stay_encoded_in_eprts_order_and_a_row_reads_alone(release):
    """The stored blocks and scales are the source's with gate and up apart (an expert's gate rows,
    then its up rows), stacked by expert: rows [a, b) decode from those rows alone, to the source's
    decoded weights in eprt's order."""
    hf, ck = release
    c, source = Checkpoint(ck), read_hf_tensors(hf)
    for m in EXPERTS:
        meta = c.meta(f"{m}.w13")
        assert (meta.encoding, meta.per_row, meta.fused_source) == (MXFP4_BLOCKS, None, f"{m}.gate_up_proj")
        blocks = c.read_component(f"{m}.w13", "blocks")
        interleaved = source[f"{m}.gate_up_proj_blocks"]
        assert torch.equal(blocks, torch.cat([interleaved[:, 0::2], interleaved[:, 1::2]], dim=1))
        decoded = decode_mxfp4_blocks(source[f"{m}.gate_up_proj_blocks"], source[f"{m}.gate_up_proj_scales"])
        want = torch.cat([decoded[:, 0::2], decoded[:, 1::2]], dim=1)
        assert torch.equal(c.read(f"{m}.w13", rows=(2, 5)), want[2:5])
        down = decode_mxfp4_blocks(source[f"{m}.down_proj_blocks"], source[f"{m}.down_proj_scales"])
        assert torch.equal(c.read(f"{m}.w2", rows=(6, 8)), down[6:8])


def test_the_unquantized_export_is_the_release_byte_for_byte(release, tmp_path):
    hf, ck = release
    source = read_hf_tensors(hf)
    exported = read_hf_tensors(export_hf(ck, str(tmp_path / "out"), progress=False))
    assert set(exported) == set(source)
    assert {n for n in source if n.endswith(("_blocks", "_scales"))} == {
        f"{m}.{p}_{c}" for m in EXPERTS for p in ("gate_up_proj", "down_proj") for c in ("blocks", "scales")
    }
    for n, t in source.items():
        assert exported[n].dtype == t.dtype and raw(exported[n]) == raw(t), n
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "mxfp4"


def test_nvfp4_reencodes_the_release_value_for_value(release, tmp_path):
    """Each expert's gate, up and down in NVFP4 decode to the release's MXFP4 values exactly, under
    ModelOpt's lossless cast's weight_scale_2 (gate and up under one k_max). The codes and block
    scales may differ from that cast's where a source block's largest code is 3 or less: a block
    scale one binade lower holds the same values (eprt reads the exponent off the decoded weight);
    the record counts every block kept."""
    shard_cast = pytest.importorskip("modelopt.torch.export.shard_cast_utils")
    hf, ck = release
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, "nvfp4_experts_only", q, calib_size=2, seq_len=16, progress=False))
    out = export_hf(q, str(tmp_path / "out"), progress=False)
    assert check_export(out, hf) == []
    source, ours = read_hf_tensors(hf), read_hf_tensors(out)
    for m in EXPERTS:
        for fused, pieces in (("gate_up_proj", ("gate_proj", "up_proj")), ("down_proj", ("down_proj",))):
            blocks, scales = source[f"{m}.{fused}_blocks"], source[f"{m}.{fused}_scales"]
            for e in range(E):
                k_max = shard_cast.mxfp4_kmax(scales[e])  # gate and up share one
                for k, piece in enumerate(pieces):
                    rows = slice(k, None, len(pieces))  # gate at the even rows, up at the odd
                    packed, grid = blocks[e, rows].flatten(-2), scales[e, rows]
                    theirs = shard_cast.quantize_mxfp4_to_nvfp4_lossless(packed, grid, k_max, "cpu")
                    name = f"{m}.{e}.{piece}"
                    got = [ours[f"{name}.{leaf}"] for leaf in ("weight", "weight_scale", "weight_scale_2")]
                    assert raw(got[2]) == raw(theirs[2]), name
                    want = decode_mxfp4_blocks(blocks[e, rows], grid).float()
                    assert torch.equal(dequantize_nvfp4(*theirs[:3]), want), name
                    assert torch.equal(dequantize_nvfp4(*got), want), name
    record = json.loads((tmp_path / "q" / "eprt.json").read_text())["quantization"]["calibration"]
    blocks = sum(source[f"{m}.{p}_scales"].numel() for m in EXPERTS for p in ("gate_up_proj", "down_proj"))
    assert record["mxfp4_reencoded"] == {"experts_tensors": 2 * LAYERS, "blocks": blocks, "kept": blocks}


def test_blocks_without_their_scales_are_refused_by_name(release, tmp_path):
    hf, _ = release
    broken = tmp_path / "hf"
    shutil.copytree(hf, broken)
    tensors = read_hf_tensors(str(broken))
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    (broken / "model.safetensors").write_bytes(save(tensors, metadata={"format": "pt"}))
    with pytest.raises(CheckpointError, match=r"'model\.layers\.1\.mlp\.experts\.down_proj_blocks'.*down_proj_scales"):
        convert_hf(str(broken), str(tmp_path / "ck"), progress=False)
    assert not (tmp_path / "ck").exists()


def test_a_malformed_mxfp4_config_is_refused_by_name(tmp_path):
    cfg = dict(tiny_config(FAMILY), quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"})
    with pytest.raises(ConfigError, match="modules_to_not_convert"):
        source_quantization(cfg, "config.json")


@pytest.mark.parametrize("recipe", ["fp8_block", "nvfp4_experts_only_input_scale1"])
def test_the_model_free_export_of_the_release_is_the_modeled_export(release, tmp_path, recipe):
    """`eprt-export HF_DIR OUT --recipe R` decodes the release's MXFP4 experts, gate and up read apart
    from their interleaved rows, each expert's rows alone: the same files as the export of its
    converted checkpoint."""
    from eprt.hf.streaming.run import stream_export

    hf, ck = release
    modeled = export_hf(ck, str(tmp_path / "modeled"), recipe=recipe, progress=False)
    ours = stream_export(hf, str(tmp_path / "ours"), recipe, progress=False)
    names = sorted(os.listdir(modeled))
    assert names == sorted(os.listdir(ours))
    for n in names:
        assert filecmp.cmp(os.path.join(modeled, n), os.path.join(ours, n), shallow=False), n
