"""Per-tensor FP8 sources (Mistral-Small-4 as released: quant_method fp8 without weight_block_size,
static activation scales, routed experts fused in `experts.gate_up_proj` with [E, 2, 1] scales):
convert keeps every stored tensor as it is, the unquantized export gives the release back byte for
byte, the decoded weights are what the compressed-tensors library decodes from the same FP8
values and scales, a rank reads only its experts' bytes, and what does not add up is refused by
name."""

import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from eprt.errors import CheckpointError, ConfigError
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.storage.checkpoint import Checkpoint
from eprt.storage.encodings import FP8_TENSOR
from eprt.testing.tiny import make_tiny, released
from tests.ep_checks import RECIPES, calibrate
from tests.hf_utils import raw, read_hf_tensors
from tests.multiproc import free_port

FAMILY = "mistral4"
EXPERTS = "model.layers.1.mlp.experts"


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-tensor")
    hf = make_tiny(FAMILY, str(root / "hf"), **released(FAMILY))
    return hf, convert_hf(hf, str(root / "ck"), progress=False)


def test_the_tiny_release_is_stored_as_the_release_stores_it(release):
    hf, _ = release
    t = read_hf_tensors(hf)
    qc = json.load(open(os.path.join(hf, "config.json")))["quantization_config"]
    assert qc == {"activation_scheme": "static", "quant_method": "fp8", "weight_block_size": None}
    assert t[f"{EXPERTS}.gate_up_proj"].dtype == torch.float8_e4m3fn
    assert t[f"{EXPERTS}.gate_up_proj_scale_inv"].shape == (8, 2, 1)
    assert t[f"{EXPERTS}.down_proj_scale_inv"].shape == (8, 1, 1)
    assert t[f"{EXPERTS}.gate_up_proj_activation_scale"].shape == (8,)
    assert t["model.layers.0.self_attn.q_a_proj.weight_scale_inv"].shape == ()
    assert t["model.layers.0.self_attn.q_a_proj.activation_scale"].shape == ()
    assert t["lm_head.weight"].dtype == torch.bfloat16 and t["model.layers.1.mlp.gate.weight"].dtype == torch.bfloat16


@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("family", [FAMILY, "mistral4_vlm"])
def test_the_unquantized_export_gives_back_the_release_byte_for_byte(release, tmp_path, reference, family):
    """The language model alone, and as released inside its vision-language model (the vision tower
    and projector in bf16, carried)."""
    hf = release[0] if family == FAMILY else make_tiny(family, str(tmp_path / "hf"), **released(family))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False, reference=reference)
    assert {m.encoding for m in Checkpoint(ck).tensors.values() if m.encoded} == {FP8_TENSOR}
    saved, exported = read_hf_tensors(hf), read_hf_tensors(export_hf(ck, str(tmp_path / "out"), progress=False))
    assert set(exported) == set(saved), sorted(set(exported) ^ set(saved))
    for name, t in saved.items():
        assert (exported[name].dtype, exported[name].shape, raw(exported[name])) == (t.dtype, t.shape, raw(t)), name


def ct_decode(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The compressed-tensors library's own decoding of one FP8 weight with one tensor-wide scale."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme

    weights = {"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False}
    scheme = QuantizationScheme.model_validate({"targets": ["Linear"], "weights": weights, "format": "float-quantized"})
    compressor = BaseCompressor.get_value_from_registry("float-quantized")
    return compressor.decompress({"weight": weight, "weight_scale": scale.reshape(1).float()}, scheme)["weight"]


def test_every_weight_decodes_as_compressed_tensors_decodes_it(release):
    pytest.importorskip("compressed_tensors")
    hf, ck_dir = release
    src, ck = read_hf_tensors(hf), Checkpoint(ck_dir)
    encoded = [m for m in ck.tensors.values() if m.encoded]
    assert len(encoded) == 2 * 8 + 2  # 8 Linears of each layer (attention, MLP or shared experts), 2 expert stacks
    for m in encoded:
        got = ck.read(m.name)
        weight = m.fused_source or m.name
        scale = src[m.fused_source + "_scale_inv" if m.fused_source else m.name + "_scale_inv"]
        stacked, scales = src[weight].unsqueeze(0) if not m.fused_source else src[weight], scale.reshape(-1, 1)
        scales = scales.reshape(stacked.shape[0], -1)
        for e in range(stacked.shape[0]):
            spans = stacked[e].chunk(scales.shape[1])
            want = torch.cat([ct_decode(w, s) for w, s in zip(spans, scales[e])]).to(torch.bfloat16)
            assert torch.equal(got.reshape(stacked.shape)[e], want), (m.name, e)


def test_a_rank_reads_only_its_experts_bytes(release):
    _, ck_dir = release
    ck = Checkpoint(ck_dir)
    whole = ck.read(f"{EXPERTS}.w13")
    before = ck.bytes_read
    rows = ck.read(f"{EXPERTS}.w13", rows=(2, 5))
    assert torch.equal(rows, whole[2:5])
    # three experts' fp8 values, their [2, 1] fp32 scales and their activation scales, nothing more
    assert ck.bytes_read - before == 3 * (64 * 64 + 2 * 4 + 4)


def edited(hf: str, out, change) -> str:
    """A copy of `hf` with its tensors (and config.json) changed by `change(tensors, config)`."""
    os.makedirs(out)
    tensors = load_file(os.path.join(hf, "model.safetensors"))
    cfg = json.load(open(os.path.join(hf, "config.json")))
    change(tensors, cfg)
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    for f in os.listdir(hf):
        if f != "model.safetensors":
            open(os.path.join(out, f), "wb").write(open(os.path.join(hf, f), "rb").read())
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    return str(out)


REFUSALS = {
    "activation scale missing": (
        lambda t, c: t.pop(f"{EXPERTS}.down_proj_activation_scale"),
        CheckpointError,
        rf"'{EXPERTS}\.down_proj' is FP8 with static activations .* but its "
        rf"'{EXPERTS}\.down_proj_activation_scale' is missing",
    ),
    "a scale per row": (
        lambda t, c: t.update({"model.layers.0.self_attn.o_proj.weight_scale_inv": torch.ones(3)}),
        CheckpointError,
        r"model\.layers\.0\.self_attn\.o_proj \(fp8-tensor, scheme fp8\) does not decode: weight_scale_inv has "
        r"shape \[3\], which is not one scale per weight of \[64, 64\]",
    ),
    "no quantization_config": (
        lambda t, c: c.pop("quantization_config"),
        CheckpointError,
        r"is an FP8 scale, but config\.json declares no FP8 quantization_config",
    ),
    "scale without its weight": (
        lambda t, c: t.update({f"{EXPERTS}.down_proj": t[f"{EXPERTS}.down_proj"].to(torch.bfloat16)}),
        CheckpointError,
        rf"FP8 scale '{EXPERTS}\.down_proj_scale_inv' has no float8_e4m3fn '{EXPERTS}\.down_proj' beside it",
    ),
    "unknown activation scheme": (
        lambda t, c: c["quantization_config"].update(activation_scheme="per-token"),
        ConfigError,
        r"activation_scheme 'per-token' is neither 'dynamic' nor 'static'",
    ),
}


@pytest.mark.parametrize("case", REFUSALS)
def test_what_does_not_add_up_is_refused_by_name(release, tmp_path, case):
    change, error, match = REFUSALS[case]
    hf = edited(release[0], tmp_path / "hf", change)
    with pytest.raises(error, match=match):
        convert_hf(hf, str(tmp_path / "ck"), progress=False)
    assert not os.path.exists(tmp_path / "ck")


@pytest.mark.parametrize("family", [FAMILY, "mistral4_vlm"])
def test_calibrated_from_the_release_every_layout_exports_and_passes_the_checks(release, tmp_path, family):
    """Calibrated from the per-tensor FP8 release (the language model alone, or inside its
    vision-language model), the ModelOpt and compressed-tensors exports hold exactly the source's
    tensors with each quantized weight's FP8 parts (scales, activation scales) replaced by the
    recipe's: eprt-check against the source finds nothing."""
    hf, ck = release
    if family != FAMILY:
        hf = make_tiny(family, str(tmp_path / "hf"), **released(family))
        ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    calibrate({"release": ck}, str(tmp_path), 1, free_port())
    for recipe, *_ in RECIPES:
        q = str(tmp_path / f"release-{recipe}-w1-ep1")
        for fmt in ("modelopt", "compressed-tensors"):
            out = export_hf(q, f"{q}-{fmt}", progress=False, fmt=fmt)
            assert check_export(out, hf) == [], (recipe, fmt)
            names = set(read_hf_tensors(out))
            assert not any(n.endswith(("_scale_inv", "activation_scale")) for n in names), (recipe, fmt)


def test_the_make_tiny_command_writes_the_release_form(release, tmp_path):
    """`eprt-make-tiny mistral4` writes what make_tiny writes as released: per-tensor FP8, experts fused."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = str(tmp_path / "hf")
    subprocess.run([sys.executable, os.path.join(root, "tools", "make_tiny.py"), FAMILY, out], check=True)
    made, want = read_hf_tensors(out), read_hf_tensors(release[0])
    assert set(made) == set(want)
    assert all((made[n].dtype, raw(made[n])) == (t.dtype, raw(t)) for n, t in want.items())


def test_the_model_run_from_the_release_is_transformers_model_of_its_decoded_export(release, tmp_path):
    """`--dequantize` writes the release's decoded weights under its names, with no quantization_config:
    transformers' Mistral4ForCausalLM loads that export and gives the logits eprt gives from the FP8
    release itself (fp32, relative max error <= 1e-4)."""
    transformers = pytest.importorskip("transformers")
    import eprt

    _, ck = release
    out = export_hf(ck, str(tmp_path / "bf16"), progress=False, dequantize=True)
    assert "quantization_config" not in json.load(open(os.path.join(out, "config.json")))
    reference = transformers.Mistral4ForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = reference(ids).logits, eprt.load_model(ck, dtype=torch.float32)(ids)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-4


def test_one_scale_shared_by_every_expert_decodes_and_a_rank_still_reads_only_its_rows(release, tmp_path):
    """Fused experts may carry one scalar scale (and activation scale) for the whole stack: every
    expert decodes with it, and a rank still reads only its experts' FP8 bytes (and the scalars)."""
    pytest.importorskip("compressed_tensors")

    def shared(t, c):
        t[f"{EXPERTS}.gate_up_proj_scale_inv"] = t[f"{EXPERTS}.gate_up_proj_scale_inv"].flatten()[0].clone()
        t[f"{EXPERTS}.gate_up_proj_activation_scale"] = torch.tensor(0.5)

    hf = edited(release[0], tmp_path / "hf", shared)
    ck = Checkpoint(convert_hf(hf, str(tmp_path / "ck"), progress=False))
    src = read_hf_tensors(hf)
    ck.read(f"{EXPERTS}.w2", rows=(0, 1))  # opens the layer's file: its header read once
    before = ck.bytes_read
    rows = ck.read(f"{EXPERTS}.w13", rows=(2, 5))
    assert ck.bytes_read - before == 3 * 64 * 64 + 4 + 4
    scale = src[f"{EXPERTS}.gate_up_proj_scale_inv"]
    for i, e in enumerate(range(2, 5)):
        assert torch.equal(rows[i], ct_decode(src[f"{EXPERTS}.gate_up_proj"][e], scale).to(torch.bfloat16))
    exported = read_hf_tensors(export_hf(str(tmp_path / "ck"), str(tmp_path / "out"), progress=False))
    assert set(exported) == set(src) and all(raw(exported[n]) == raw(t) for n, t in src.items())
