"""MXFP8 and MXFP4 (`format: mxfp8`, `format: mxfp4`) against references nobody here wrote.

- The numerics: ModelOpt's MXFP8 quantizer (`MXFP8QTensor`) gives eprt's E8M0 scales and codes, for
  weights and for inputs; MXFP4's scales are compressed-tensors' (`generate_mx_scales`, the OCP
  rule), and ModelOpt's MXFP4 quantizer, which clips nothing, gives mse's first candidates (its E2M1
  rounding sends ties down; compressed-tensors', below, to even, as eprt's).
- The ModelOpt layout (MXFP8): byte for byte ModelOpt 0.47's `export_hf_checkpoint` of its MXFP8
  config on the same model, and the same hf_quant_config.json. MXFP4 has none: it is refused by name.
- The compressed-tensors layout (both): the library's compressor decompresses every module to eprt's
  dequantized values exactly, and compresses the source weights under eprt's scales to eprt's bytes;
  transformers loads the MXFP4 export on CPU with every weight equal to eprt's dequantization. It
  cannot load MXFP8's routed experts: its expert loader folds a scale into an FP8 weight by a plain
  product, which fits per-tensor and per-channel scales, not E8M0 bytes per 32 elements.
- A Kimi-K3 MXFP4 source, converted and quantized to MXFP4 again, exports its own bytes and scales;
  quantized to NVFP4, its experts are re-encoded value for value: ModelOpt 0.47's closed-form cast
  (`quantize_mxfp4_to_nvfp4_lossless`) gives the same bytes, and where a block lies beyond E4M3's
  range of powers of two it is rounded, and counted in the calibration record and quality report.
- eprt-check passes every export and refuses a NaN (byte 255) and a misshapen scale in each.
- The layouts: tests/layouts/test_formats_ep.py runs both recipes at ep 2 with every other shipped one.
"""

import json
import os
import re
from pathlib import Path

import pytest
import torch

from eprt.errors import ConfigError
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.formats import weight_format
from eprt.quant.formats.e2m1 import pack_fp4
from eprt.quant.formats.e8m0 import e8m0_values
from eprt.quant.formats.mxfp4 import dequantize_mxfp4, mxfp4_scales
from eprt.quant.formats.mxfp8 import dequantize_mxfp8, fake_quant_mx_input, mxfp8_scales, quantize_mxfp8
from eprt.quant.formats.nvfp4 import dequantize_nvfp4
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.formats_helpers import assert_transformers_loads, broken_copy, set_first
from tests.hf_utils import raw, read_hf_tensors

SAMPLES, SEQ_LEN = 2, 16
CT = "compressed-tensors"
EXPORTS = [("mxfp8", "modelopt"), ("mxfp8", CT), ("mxfp4", CT)]


def ptq(state: ParallelState, ck: str, recipe: str, out: str) -> None:
    run_ptq(state, PTQArgs(ck, recipe, out, calib_size=SAMPLES, seq_len=SEQ_LEN, batch_size=SAMPLES, progress=False))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(source dir, eprt checkpoint, {(recipe, layout): export})."""
    d = tmp_path_factory.mktemp("mx")
    hf = make_tiny("qwen3_moe", str(d / "hf"))
    ck = convert_hf(hf, str(d / "ck"), progress=False)
    exports = {}
    for recipe, layout in EXPORTS:
        q = str(d / recipe)
        if not os.path.exists(q):
            ptq(ParallelState.single(), ck, recipe, q)
        exports[recipe, layout] = export_hf(q, f"{q}-{layout}", progress=False, fmt=layout)
    return hf, ck, exports


def weights() -> torch.Tensor:
    """A stack of bf16 weights whose blocks span many binades, with a zero block."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(2, 48, 128, generator=g) * torch.exp2(
        torch.randint(-12, 8, (2, 48, 4), generator=g)
    ).repeat_interleave(32, -1)
    w[1, 3, :32] = 0
    return w.bfloat16()


def test_the_numerics_are_modelopts_quantizers():
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    w = weights()
    theirs, their_scales = qtensor.MXFP8QTensor.quantize(w)
    scales = mxfp8_scales(w)
    assert scales[1, 3, 0] == 0  # a zero block: byte 0, as ModelOpt writes it
    assert raw(their_scales) == raw(scales)
    assert raw(theirs._quantized_data) == raw(quantize_mxfp8(w, scales))
    assert torch.equal(fake_quant_mx_input(w), theirs.dequantize(scale=their_scales))  # inputs, block by block
    assert torch.equal(
        dequantize_mxfp8(quantize_mxfp8(w, scales), scales), theirs.dequantize(torch.float32, scale=scales)
    )
    # MXFP4's scales: compressed-tensors' (the OCP rule, llm-compressor's) of each block's amax in the
    # weight's dtype; ModelOpt's, which clip nothing, are mse's first candidates
    from compressed_tensors.quantization.utils.mxfp_utils import generate_mx_scales

    scales = mxfp4_scales(w)
    amax = w.abs().reshape(*scales.shape, 32).amax(-1)
    theirs = generate_mx_scales(amax)
    assert torch.equal(theirs[amax > 0].to(torch.uint8), scales[amax > 0]) and scales[1, 3, 0] == 0
    _, their_fp4_scales = qtensor.MXFP4QTensor.quantize(w, 32)
    clipping_nothing = weight_format("mxfp4").mse_candidates(w)[0]
    assert raw(their_fp4_scales.reshape(scales.shape)) == raw(clipping_nothing)
    assert (clipping_nothing != scales).any()  # blocks whose amax lies above 6 x their OCP scale


def test_the_modelopt_export_is_modelopts(model, tmp_path):
    pytest.importorskip("modelopt")
    pytest.importorskip("transformers")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    hf, _, exports = model
    torch_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    tokens = torch.randint(0, 500, (16, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(torch_model, mtq.MXFP8_DEFAULT_CFG, lambda m: m(tokens))
    export_hf_checkpoint(torch_model, export_dir=str(tmp_path / "modelopt"))
    theirs, ours = read_hf_tensors(str(tmp_path / "modelopt")), read_hf_tensors(exports["mxfp8", "modelopt"])
    assert set(theirs) == set(ours)
    for name in sorted(theirs):
        assert theirs[name].dtype == ours[name].dtype and raw(theirs[name]) == raw(ours[name]), name
    their_q = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())["quantization"]
    our_q = json.loads(Path(exports["mxfp8", "modelopt"], "hf_quant_config.json").read_text())["quantization"]
    assert their_q == our_q


@pytest.mark.parametrize("recipe", ["mxfp8", "mxfp4"])
def test_compressed_tensors_decompresses_and_compresses_as_eprt(model, recipe):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    hf, _, exports = model
    fmt = weight_format(recipe)
    ct = exports[recipe, CT]
    qc = QuantizationConfig.model_validate(json.loads(Path(ct, "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    assert (scheme.format, scheme.weights.group_size, scheme.weights.scale_dtype) == (fmt.ct_format, 32, torch.uint8)
    assert (scheme.input_activations is not None) == (recipe == "mxfp8")
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    t, source = read_hf_tensors(ct), read_hf_tensors(hf)
    modules = sorted(n[: -len(".weight_scale")] for n in t if n.endswith(".weight_scale"))
    assert any(".experts." in m for m in modules) and any("self_attn" in m for m in modules)
    for module in modules:
        stored = {leaf: t[f"{module}.{leaf}"] for leaf in fmt.ct_leaves}
        ours = fmt.dequantize(
            {"weight": stored[fmt.ct_weight_leaf], "weight_scale": stored["weight_scale"]}, torch.float32
        )
        assert torch.equal(compressor.decompress(stored, scheme)["weight"].float(), ours), module
        w = source[f"{module}.weight"]
        compressed = compressor.compress(
            {"weight": w, "weight_scale": e8m0_values(stored["weight_scale"]).to(w.dtype)}, scheme
        )
        for leaf in stored:
            assert raw(compressed[leaf]) == raw(stored[leaf]), f"{module}.{leaf}"


def test_transformers_loads_the_mxfp4_export(model):
    ct = model[2]["mxfp4", CT]
    t = read_hf_tensors(ct)
    fmt = weight_format("mxfp4")

    def eprt_value(module: str) -> torch.Tensor:
        return fmt.dequantize(
            {"weight": t[f"{module}.weight_packed"], "weight_scale": t[f"{module}.weight_scale"]}, torch.bfloat16
        )

    assert_transformers_loads(ct, eprt_value)


def test_the_modelopt_layout_asked_for_refuses_mxfp4_by_name(model, tmp_path):
    _, _, exports = model
    q = exports["mxfp4", CT][: -len(f"-{CT}")]
    with pytest.raises(
        ConfigError, match=r"quantized with mxfp4 \(MXFP4\), .*export it with --format compressed-tensors"
    ):
        export_hf(q, str(tmp_path / "out"), progress=False, fmt="modelopt")
    assert not (tmp_path / "out").exists()


def test_the_export_chooses_the_layout_that_holds_mxfp4(model, tmp_path):
    _, _, exports = model
    q = exports["mxfp4", CT][: -len(f"-{CT}")]
    export_hf(q, str(tmp_path / "out"), progress=False)  # no --format: the one layout that holds it
    asked = Path(exports["mxfp4", CT])
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(asked))
    for f in os.listdir(asked):
        assert (tmp_path / "out" / f).read_bytes() == (asked / f).read_bytes(), f


@pytest.fixture(scope="module")
def kimi_k3(tmp_path_factory):
    """(source dir, eprt checkpoint) of a tiny Kimi-K3 whose routed experts are stored in MXFP4."""
    d = tmp_path_factory.mktemp("k3")
    hf = make_tiny("kimi_k3", str(d / "hf"), source_format="mxfp4")
    return hf, convert_hf(hf, str(d / "ck"), progress=False)


def test_a_kimi_k3_mxfp4_source_gives_back_its_own_bytes(kimi_k3, tmp_path):
    """K3's MXFP4 experts, converted (kept encoded) and quantized to MXFP4 again by RTN: the export
    holds exactly the source's tensors, names and bytes, its negative zeros included."""
    hf, ck = kimi_k3
    recipe = tmp_path / "experts.yaml"
    recipe.write_text(
        'name: k3\nquantize:\n  - {pattern: "*.experts", format: mxfp4}\n  - {pattern: "*", format: none}\n'
    )
    ptq(ParallelState.single(), ck, str(recipe), str(tmp_path / "q"))
    out = export_hf(str(tmp_path / "q"), str(tmp_path / "ct"), progress=False, fmt=CT)
    assert check_export(out) == []
    source, ours = read_hf_tensors(hf), read_hf_tensors(out)
    assert set(source) == set(ours)
    packed = [n for n in source if n.endswith(".weight_packed")]
    assert packed and any(unpack_has_negative_zero(source[n]) for n in packed)
    for name in sorted(packed) + sorted(n.replace("weight_packed", "weight_scale") for n in packed):
        assert raw(source[name]) == raw(ours[name]), name


def unpack_has_negative_zero(packed: torch.Tensor) -> bool:
    return bool(((packed & 0x0F) == 8).any() or ((packed >> 4) == 8).any())


@pytest.mark.parametrize(("recipe", "layout"), EXPORTS)
def test_check_passes_the_export(model, recipe, layout):
    assert check_export(model[2][recipe, layout]) == []


@pytest.mark.parametrize(("recipe", "layout"), EXPORTS)
@pytest.mark.parametrize(
    "edit, fault",
    [(set_first(255), "block scale(s) zero, negative or NaN"), (lambda t: t[:3].contiguous(), "expected")],
    ids=["nan", "misshapen"],
)
def test_check_refuses_a_corrupted_scale(model, tmp_path, recipe, layout, edit, fault):
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    problems = check_export(broken_copy(model[2][recipe, layout], tmp_path / "x", name, edit))
    assert any(p.startswith(name) and fault in p for p in problems), problems


def test_kimi_k3_mxfp4_experts_in_nvfp4_are_modelopts_lossless_cast(kimi_k3, tmp_path):
    shard_cast = pytest.importorskip("modelopt.torch.export.shard_cast_utils")
    hf, ck = kimi_k3
    ptq(ParallelState.single(), ck, "nvfp4_experts_only", str(tmp_path / "q"))
    out = export_hf(str(tmp_path / "q"), str(tmp_path / "out"), progress=False)
    assert check_export(out) == []
    source, ours = read_hf_tensors(hf), read_hf_tensors(out)
    experts = sorted(n[: -len(".weight_packed")] for n in source if n.endswith(".weight_packed"))
    assert experts
    for m in experts:
        fused = [re.sub(r"\.w[13]$", w, m) for w in (".w1", ".w3")] if re.search(r"\.w[13]$", m) else [m]
        k_max = max(shard_cast.mxfp4_kmax(source[f"{f}.weight_scale"]) for f in fused)  # gate and up share one
        theirs = shard_cast.quantize_mxfp4_to_nvfp4_lossless(
            source[f"{m}.weight_packed"], source[f"{m}.weight_scale"], k_max, "cpu"
        )
        for leaf, t in zip(("weight", "weight_scale", "weight_scale_2"), theirs):
            assert t.dtype == ours[f"{m}.{leaf}"].dtype and raw(t) == raw(ours[f"{m}.{leaf}"]), f"{m}.{leaf}"
        assert torch.equal(
            dequantize_nvfp4(ours[f"{m}.weight"], ours[f"{m}.weight_scale"], ours[f"{m}.weight_scale_2"]),
            dequantize_mxfp4(source[f"{m}.weight_packed"], source[f"{m}.weight_scale"]),
        ), m
    record = json.loads((tmp_path / "q" / "eprt.json").read_text())["quantization"]["calibration"]
    blocks = sum(source[f"{m}.weight_scale"].numel() for m in experts)
    assert record["mxfp4_reencoded"] == {"experts_tensors": 6, "blocks": blocks, "kept": blocks}
    quality = json.loads(Path(out, "eprt_quality.json").read_text())
    assert quality["calibration"]["mxfp4_reencoded"] == record["mxfp4_reencoded"]


def test_mxfp4_blocks_beyond_e4m3s_range_are_counted_and_rounded():
    """Two experts of MXFP4 blocks 0 to 20 binades below each one's largest: NVFP4 keeps the values of
    every block within 17 binades, as ModelOpt's closed-form cast, which counts the same blocks."""
    shard_cast = pytest.importorskip("modelopt.torch.export.shard_cast_utils")
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (2, 4, 21 * 32), generator=g, dtype=torch.uint8)
    codes[..., ::32] = 7  # each block reaches 6, as compressed-tensors' observer leaves MXFP4 blocks
    scales = (torch.arange(21) + torch.tensor([100, 90]).view(2, 1, 1)).expand(2, 4, 21).to(torch.uint8)
    packed = pack_fp4(codes)
    w = dequantize_mxfp4(packed, scales, torch.bfloat16)
    nvfp4 = weight_format("nvfp4")
    assert nvfp4.exact_weight_scale(w.float().normal_(generator=g).bfloat16()) is None  # a bf16 weight: the amax rule
    assert nvfp4.mxfp4_blocks_kept(scales) == (2 * 4 * 21, 2 * 4 * 18)  # 3 of 21 exponents per row below the range
    for e in range(2):
        scale_2 = nvfp4.exact_weight_scale(w[e])
        ours = nvfp4.quantize(w[e], scale_2, mse=False)
        q, block_scale, theirs_2, blocks, lossless = shard_cast.quantize_mxfp4_to_nvfp4_lossless(
            packed[e], scales[e], int(scales[e].max()) - 127, "cpu"
        )
        assert (blocks, lossless) == (4 * 21, 4 * 18)
        assert raw(ours["weight"]) == raw(q) and raw(ours["weight_scale"]) == raw(block_scale)
        assert raw(ours["weight_scale_2"]) == raw(theirs_2)
        decoded = nvfp4.dequantize(ours, torch.float32)
        assert torch.equal(decoded[:, 3 * 32 :], w[e, :, 3 * 32 :].float())  # the 18 blocks within range
        assert not torch.equal(decoded[:, : 3 * 32], w[e, :, : 3 * 32].float())
