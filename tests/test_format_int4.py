"""INT4 weights (`format: int4`, `int4_g32`: W4A16) and W4A8 (`format: w4a8`) against references nobody here wrote.

- The numerics: compressed-tensors' own quantizer, given eprt's group scales, encodes a weight to
  eprt's codes, its `pack_to_int32` packs them to eprt's words, and its unpacking and dequantization
  give eprt's values; the scales are the Kimi releases' grid (amax / 7 in bf16, codes -7..7) or, on
  the full grid (a rule's `grid: full`), the library's own (its `calculate_qparams`: amax / 7.5 in
  bf16, codes -8..7), or a bf16 neighbour of either that decodes the group closer.
- The compressed-tensors layout, for RTN in groups of 128, GPTQ in groups of 32 and W4A8: its config
  parses with the library's classes as the W4A16 / W4AFP8 schemes, the library decompresses every
  module to eprt's dequantized values exactly, and transformers loads the INT4 and the W4A8 export on
  CPU with every quantized weight, routed experts included, equal to eprt's dequantization.
- A Kimi INT4 source (the tiny one, made by the library's compressor), converted and re-quantized by
  RTN in groups of 32, gives back its own codes and scales in every group on the Kimi grid that
  reaches its extreme code, 7 or -7.
- eprt-check passes each export, names exactly the source's tensors, and refuses a zero, a NaN, a
  subnormal and a misshapen group scale; the ModelOpt layout is refused by name.
- A rule's `group_size` picks the groups; the export is the same bytes from two ranks at ep 2.
"""

import json
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import yaml

from eprt.errors import ConfigError
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.algorithms.search.auto_quantize import rule_format
from eprt.quant.formats import weight_format
from eprt.quant.formats.int4 import (
    FULL,
    GRIDS,
    INT4,
    KIMI,
    dequantize_int4,
    int4_codes,
    int4_scales,
    pack_int4,
    unpack_int4,
)
from eprt.quant.formats.w4a8 import W4A8
from eprt.quant.recipe import parse_recipe
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.source_grid import checkpoint_int4_grid, hf_int4_grid
from eprt.storage.checkpoint import Checkpoint
from eprt.storage.encodings import source_quantization
from eprt.testing.tiny import make_tiny
from tests.formats_helpers import assert_transformers_loads, broken_copy, set_first
from tests.hf_utils import raw, read_hf_tensors
from tests.multiproc import run_world

SAMPLES, SEQ_LEN = 2, 16
# every quantized Linear's input dim a multiple of 128
WIDE = dict(hidden_size=128, intermediate_size=256, moe_intermediate_size=128, head_dim=32)
# (recipe, algorithm, the rule's grid): the Kimi grid named by the rule (a recipe of the test's own);
# none named, the shipped recipe takes the source's, which is no Kimi release: the full grid
CASES = {
    "int4": ("int4", "max", "kimi"),
    "int4_g32-gptq": ("int4_g32", "gptq", "kimi"),
    "w4a8": ("w4a8", "max", "kimi"),
    "int4_full": ("int4", "max", None),
    "int4_g32_full-gptq": ("int4_g32", "gptq", None),
    "w4a8_full": ("w4a8", "max", None),
}
KIMI_EXPERTS = {
    "name": "kimi_experts_int4",
    "quantize": [{"pattern": "*.experts", "format": "int4", "group_size": 32}, {"pattern": "*", "format": "none"}],
}


def ptq(state: ParallelState, ck: str, out: str, recipe: str, algorithm: str) -> None:
    args = dict(calib_size=SAMPLES, seq_len=SEQ_LEN, batch_size=SAMPLES, progress=False, algorithm=algorithm)
    run_ptq(state, PTQArgs(ck, recipe, out, **args))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(source dir, eprt checkpoint, {case: (calibrated checkpoint, compressed-tensors export)})."""
    d = tmp_path_factory.mktemp("int4")
    hf = make_tiny("qwen3_moe", str(d / "hf"), **WIDE)
    ck = convert_hf(hf, str(d / "ck"), progress=False)
    out = {}
    for case, (recipe, algorithm, grid) in CASES.items():
        if grid is not None:
            rule = {"pattern": "*", "format": recipe, "grid": grid}
            (d / f"{case}.json").write_text(json.dumps({"name": recipe, "quantize": [rule]}))
            recipe = str(d / f"{case}.json")
        q = str(d / case)
        ptq(ParallelState.single(), ck, q, recipe, algorithm)
        out[case] = (q, export_hf(q, q + "-ct", progress=False, fmt="compressed-tensors"))
    return hf, ck, out


@pytest.mark.parametrize("grid", [KIMI, FULL], ids=lambda g: g.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_the_numerics_are_compressed_tensors_quantizer_and_packing(dtype, grid):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs, preset_name_to_scheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize, fake_quantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    w = torch.randn(2, 24, 256, generator=torch.Generator().manual_seed(0)).to(dtype)
    w[1, 3, :128] = 0  # zero groups: scale 1, codes 0
    w[0, 5, :128] *= torch.finfo(dtype).tiny  # groups whose amax / 7 is subnormal (fp16: tiny, yet normal in bf16)
    # the quotient in the weight's dtype where it is bf16 or fp32, else in fp32
    x = w if dtype in (torch.bfloat16, torch.float32) else w.float()
    for group in (128, 32):
        args = QuantizationArgs(num_bits=4, type="int", strategy="group", group_size=group, symmetric=True)
        scales = int4_scales(w, group, grid)
        codes = int4_codes(w, scales, grid)
        assert (codes.min(), codes.max()) == (grid.lowest, 7) and scales[1, 3, 0] == 1 and not codes[1, 3, :128].any()
        # amax / the grid's divisor in bf16, or the bf16 neighbour of it the library decodes closer
        amax = w.float().abs().reshape(2, 24, -1, group).amax(-1)
        # scales no smaller than the least normal fp32 (and bf16) number
        tiny = torch.finfo(torch.float32).tiny
        nearest = torch.where(amax == 0, 1.0, amax / grid.divisor).bfloat16().clamp(min=tiny)
        if grid is FULL and dtype == torch.bfloat16:  # the library's own scale of a bf16 group, where it is normal
            groups = w.reshape(2, 24, -1, group)
            theirs, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
            normal = amax / grid.divisor >= tiny
            assert torch.equal(theirs[normal], nearest[normal]) and normal.float().mean() > 0.9
        errors = []
        for step in (0, 1, -1):
            s = (nearest.view(torch.int16) + step).view(torch.bfloat16).clamp(min=tiny)
            zero = torch.zeros_like(s[0])
            values = torch.stack(
                [dequantize(quantize(x[e], s[e], zero, args, dtype=torch.int8), s[e], args=args) for e in range(2)]
            )
            errors.append((values.double() - w.double()).reshape(*s.shape, group).square().sum(-1))
        step = (scales.view(torch.int16) - nearest.view(torch.int16)).long()
        assert step.abs().max() <= 1
        errors = torch.stack(errors)  # by step 0, 1, -1: index step % 3
        least = errors.amin(0)
        assert torch.equal(errors.gather(0, (step % 3)[None])[0], least)
        assert (step == 0)[errors[0] == least].all()  # a tie keeps amax / the divisor
        for e in range(2):
            theirs = quantize(x[e], scales[e], torch.zeros_like(scales[e]), args, dtype=torch.int8)
            assert torch.equal(theirs, codes[e])
            packed = pack_int4(codes[e])
            assert raw(pack_to_int32(codes[e], 4)) == raw(packed)
            assert torch.equal(unpack_from_int32(packed, 4, torch.Size(w[e].shape)), unpack_int4(packed))
            values = dequantize(unpack_from_int32(packed, 4, torch.Size(w[e].shape)), scales[e], args=args)
            assert torch.equal(values, dequantize_int4(packed, scales[e], torch.bfloat16))
        # mse: each group's error never above max's, below it somewhere
        errors = []
        for mse in (False, True):
            fmt = next(
                f
                for f in (INT4, *map(weight_format, ("int4_g32", "int4_full", "int4_g32_full")))
                if (f.group_size, f.grid) == (group, grid)
            )
            t = fmt.quantize(w, INT4.scale(0.0), mse)
            if not mse:  # the export's tensors: these scales and codes
                assert torch.equal(t["weight_scale"], scales) and torch.equal(t["weight"], pack_int4(codes))
            values = dequantize_int4(t["weight"], t["weight_scale"], torch.bfloat16).double()
            errors.append((values - w.double()).reshape(*scales.shape, group).square().sum(-1))
        assert (errors[1] <= errors[0]).all() and (errors[1] < errors[0]).any()
    # W4A8's inputs: FP8 per token at run time, as the W4AFP8 scheme's input activations
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(1)) * 3
    inputs = preset_name_to_scheme("W4AFP8", ["Linear"]).input_activations
    scale, zero = calculate_qparams(x.amin(-1, keepdim=True), x.amax(-1, keepdim=True), inputs)
    assert torch.equal(W4A8.fake_quantize_input(x, None), fake_quantize(x, scale, zero, inputs))
    assert INT4.fake_quantize_input(x, None) is x


@pytest.mark.parametrize("case", CASES)
def test_compressed_tensors_decompresses_every_module_to_eprts_values(model, case):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import quantize

    hf, _, exports = model
    ct = exports[case][1]
    qc = QuantizationConfig.model_validate(json.loads(Path(ct, "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    w, a = scheme.weights, scheme.input_activations
    assert (qc.format, w.type, w.num_bits, w.strategy, w.symmetric) == ("pack-quantized", "int", 4, "group", True)
    assert w.group_size == (32 if "g32" in case else 128)
    w4a8 = case.startswith("w4a8")
    assert (a.type, a.num_bits, a.strategy, a.dynamic) == ("float", 8, "token", True) if w4a8 else a is None
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    t, source = read_hf_tensors(ct), read_hf_tensors(hf)
    modules = sorted(n[: -len(".weight_packed")] for n in t if n.endswith(".weight_packed"))
    assert any(".experts." in m for m in modules) and any("self_attn" in m for m in modules)
    lowest = []
    for module in modules:
        packed, scales = t[f"{module}.weight_packed"], t[f"{module}.weight_scale"]
        assert t[f"{module}.weight_shape"].tolist() == list(source[f"{module}.weight"].shape), module
        state = {leaf: t[f"{module}.{leaf}"] for leaf in compressor.compression_param_names(scheme)}
        decompressed = compressor.decompress(state, scheme)["weight"]
        assert torch.equal(decompressed, dequantize_int4(packed, scales, torch.bfloat16)), module
        codes = unpack_int4(packed)
        lowest.append(codes.min().item())
        if not case.endswith("gptq"):  # RTN: the library's codes of the source weights under eprt's scales
            theirs = quantize(source[f"{module}.weight"], scales, torch.zeros_like(scales), w, dtype=torch.int8)
            assert torch.equal(theirs, codes), module
    assert min(lowest) == (-8 if "full" in case else -7)  # the grid's lowest code is written, and only there


@pytest.mark.parametrize("case", ["int4", "w4a8", "int4_full"])
def test_transformers_loads_eprts_values(model, case):
    _, _, exports = model
    ct = exports[case][1]
    t = read_hf_tensors(ct)

    def eprt_value(module: str) -> torch.Tensor:
        return dequantize_int4(t[f"{module}.weight_packed"], t[f"{module}.weight_scale"], torch.bfloat16)

    assert_transformers_loads(ct, eprt_value)


def test_a_kimi_int4_source_requantizes_to_its_own_codes_and_scales(tmp_path):
    pytest.importorskip("compressed_tensors")
    hf = make_tiny(
        "deepseek_v3", str(tmp_path / "hf"), source_format="int4", model_type="kimi_k2", num_nextn_predict_layers=0
    )
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    (tmp_path / "r.yaml").write_text(json.dumps(KIMI_EXPERTS))
    q = str(tmp_path / "q")
    ptq(ParallelState.single(), ck, q, str(tmp_path / "r.yaml"), "max")
    ours, source = (
        read_hf_tensors(export_hf(q, q + "-ct", progress=False, fmt="compressed-tensors")),
        read_hf_tensors(hf),
    )
    assert check_export(q + "-ct", hf) == []
    modules = sorted(n[: -len(".weight_packed")] for n in source if n.endswith(".weight_packed"))
    assert modules and all(".experts." in m for m in modules)
    kept = 0
    for module in modules:
        codes = unpack_int4(source[f"{module}.weight_packed"]).reshape(*source[f"{module}.weight_scale"].shape, 32)
        words = source[f"{module}.weight_packed"].reshape(codes.shape[0], codes.shape[1], 4)
        # the groups on the Kimi grid (-7..7) that reach its extreme code: the library's min-max
        # quantizer (amax / 7.5) leaves the others at -8 or short of 7
        on_grid = (codes.amin(-1) >= -7) & (codes.abs().amax(-1) == 7)
        ours_words = ours[f"{module}.weight_packed"].reshape(words.shape)
        assert torch.equal(ours_words[on_grid], words[on_grid]), module
        assert raw(ours[f"{module}.weight_scale"][on_grid]) == raw(source[f"{module}.weight_scale"][on_grid]), module
        kept += int(on_grid.sum())
    assert kept > 100


@pytest.mark.parametrize(
    "model_type, source_format, grid",
    [("kimi_k2", "int4", "kimi"), ("deepseek_v3", "int4", "full"), ("kimi_k2", None, "full")],
)
def test_a_rule_naming_no_grid_takes_the_sources(tmp_path, model_type, source_format, grid):
    """The Kimi grid for a Kimi release stored in INT4 (whose round trip is above), the full grid for
    any other source, stored in INT4 or not: as converted (the data-free export's, the calibration's)
    and as Hugging Face holds it (the model-free export's)."""
    if source_format:
        pytest.importorskip("compressed_tensors")
    extra = {"source_format": source_format} if source_format else {}
    hf = make_tiny("deepseek_v3", str(tmp_path / "hf"), model_type=model_type, num_nextn_predict_layers=0, **extra)
    with Checkpoint(convert_hf(hf, str(tmp_path / "ck"), progress=False)) as ck:
        assert checkpoint_int4_grid(ck) == grid
    config = json.loads(Path(hf, "config.json").read_text())
    assert hf_int4_grid(config, source_quantization(config, "config.json")) == grid
    recipe = parse_recipe(KIMI_EXPERTS, "r.yaml").on_source(grid)
    assert recipe.format_of("model.layers.1.mlp.experts") == ("int4_g32" if grid == "kimi" else "int4_g32_full")


@pytest.mark.parametrize("fmt", ["int4_g32", "w4a8", "int4_full"])
def test_the_format_searchs_written_rule_keeps_the_grid_it_measured(fmt):
    """`--recipe OUT/auto_recipe.yaml` on any source quantizes as the search measured: its rules name the grid."""
    text = f'quantize:\n  - {{pattern: "*", format: {rule_format(fmt)}}}\n'
    for source in GRIDS:
        assert parse_recipe(yaml.safe_load(text), "auto_recipe.yaml").on_source(source).rules[0].format == fmt


def test_the_data_free_export_takes_the_sources_grid_as_calibration_does(model, tmp_path):
    _, ck, exports = model
    out = export_hf(ck, str(tmp_path / "x"), progress=False, fmt="compressed-tensors", recipe="int4")
    weights = sorted(n for n in os.listdir(out) if n.endswith(".safetensors"))
    assert weights and weights == sorted(n for n in os.listdir(exports["int4_full"][1]) if n.endswith(".safetensors"))
    for n in weights:
        assert Path(out, n).read_bytes() == Path(exports["int4_full"][1], n).read_bytes(), n


def test_the_calibrated_checkpoint_records_the_grid_by_its_formats_name(model):
    _, _, exports = model
    for case, (recipe, _, grid) in CASES.items():
        with Checkpoint(exports[case][0]) as q:
            (rule,) = q.quantization["recipe"]["quantize"]
        assert rule["format"] == (recipe if grid == "kimi" else f"{recipe}_full"), case


def test_check_passes_every_export_with_the_sources_names(model):
    hf, _, exports = model
    for _, ct in exports.values():
        assert check_export(ct, hf) == []


@pytest.mark.parametrize(
    "leaf, edit, fault",
    [
        ("weight_scale", set_first(0.0), "block scale(s) zero, negative or NaN"),
        ("weight_scale", set_first(float("nan")), "block scale(s) zero, negative or NaN"),
        ("weight_scale", set_first(1e-40), "subnormal"),
        ("weight_scale", lambda t: t[:3].contiguous(), "expected"),
        ("weight_shape", set_first(64), "[64, 128], its weight_packed [128, 16] holds a weight [128, 128]"),
    ],
)
def test_check_refuses_a_corrupted_scale(model, tmp_path, leaf, edit, fault):
    _, _, exports = model
    name = f"model.layers.0.self_attn.q_proj.{leaf}"
    problems = check_export(broken_copy(exports["int4"][1], tmp_path / "x", name, edit))
    assert any(p.startswith(name) and fault in p for p in problems), problems


def test_the_modelopt_layout_is_refused_by_name(model, tmp_path):
    _, _, exports = model
    with pytest.raises(ConfigError, match=r"q_proj is quantized with w4a8 \(W4AFP8\).*--format compressed-tensors"):
        export_hf(exports["w4a8"][0], str(tmp_path / "modelopt"), progress=False, fmt="modelopt")
    assert not (tmp_path / "modelopt").exists()


def test_a_rules_group_size_picks_the_groups():
    def rule(**extra):
        return parse_recipe({"quantize": [{"pattern": "*", **extra}]}, "r.yaml").rules[0].format

    assert rule(format="int4") == rule(format="int4", group_size=128) == "int4"
    assert rule(format="int4", group_size=32) == rule(format="int4_g32") == "int4_g32"
    with pytest.raises(ConfigError, match=r"group_size 64: int4 comes in groups of 32 or 128; choose one"):
        rule(format="int4", group_size=64)
    with pytest.raises(ConfigError, match=r"format 'fp8' has no groups to size; drop group_size"):
        rule(format="fp8", group_size=32)


def test_a_rules_grid_picks_the_grid():
    def rule(**extra):
        return parse_recipe({"quantize": [{"pattern": "*", **extra}]}, "r.yaml").rules[0].format

    assert rule(format="int4", grid="kimi") == "int4" and rule(format="int4_g32", grid="full") == "int4_g32_full"
    assert rule(format="int4", group_size=32, grid="full") == rule(format="int4_full", group_size=32)
    assert weight_format(rule(format="int4", grid="full")).grid is FULL
    with pytest.raises(ConfigError, match=r"grid 'coarse': int4 comes on the kimi or full grid; choose one"):
        rule(format="int4", grid="coarse")
    assert rule(format="w4a8", grid="full") == "w4a8_full"
    with pytest.raises(ConfigError, match=r"format 'nvfp4' has no INT4 grid to choose; drop grid"):
        rule(format="nvfp4", grid="full")
    with pytest.raises(ConfigError, match=r"'int4_full' is on the full grid, so the rule asks for two grids"):
        rule(format="int4_full", grid="kimi")


def _ptq_ep2(ck: str, out: str) -> None:
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        ptq(state, ck, out, "int4_g32", "gptq")


def test_two_ranks_at_ep_2_export_the_same_bytes(model, tmp_path):
    _, ck, exports = model
    run_world(_ptq_ep2, 2, ck, str(tmp_path / "q"), timeout=300)
    ours = export_hf(str(tmp_path / "q"), str(tmp_path / "export"), progress=False, fmt="compressed-tensors")
    single = exports["int4_g32_full-gptq"][1]  # the shipped recipe: the source's grid
    names = sorted(os.listdir(single))
    assert names == sorted(os.listdir(ours))
    for n in names:
        assert Path(single, n).read_bytes() == Path(ours, n).read_bytes(), n
