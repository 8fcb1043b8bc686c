"""Each registered weight format's descriptions agree with what its numerics produce: the exporter
writes the tensors `quantize` returns under the names, dtypes and shapes `modelopt_tensors` and
`compressed_tensors_tensors` declare, and the checkers trust those declarations, so a format whose
declaration and numerics disagree would export files its own checker refuses (or passes wrongly)."""

import pytest
import torch

from eprt.errors import ConfigError
from eprt.quant.formats import WEIGHT_FORMATS, by_ct_format, by_modelopt_weight_dtype, by_quant_algo
from eprt.quant.numerics import abs_amax
from eprt.quant.recipe import FORMATS, parse_recipe

OUT, IN = 32, 128  # whole groups of every format (INT4: 128)


def quantized(fmt, w: torch.Tensor, mse: bool = False) -> dict[str, torch.Tensor]:
    """Every ModelOpt tensor of w, input_scale included where the format has one, as the exporter
    assembles them (it writes the declared ones)."""
    inputs = {"input_scale": fmt.scale(torch.tensor(3.0))} if fmt.modelopt_per_tensor_scales[1] else {}
    return {**inputs, **fmt.quantize(w, fmt.scale(abs_amax(w)), mse)}


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS.values(), ids=WEIGHT_FORMATS)
@pytest.mark.parametrize("mse", [False, True])
def test_quantize_writes_what_the_layouts_declare(fmt, mse):
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(0)).bfloat16()
    modelopt = quantized(fmt, w, mse)
    declared = fmt.modelopt_tensors(OUT, IN)
    assert set(modelopt) == set(declared)
    for leaf, (dtype, shape) in declared.items():
        assert (modelopt[leaf].dtype, tuple(modelopt[leaf].shape)) == (dtype, shape), leaf
    ct = fmt.to_compressed_tensors(modelopt)
    ct_declared = fmt.compressed_tensors_tensors(OUT, IN)
    assert list(ct) == list(ct_declared)
    for leaf, (dtype, shape) in ct_declared.items():
        assert (ct[leaf].dtype, tuple(ct[leaf].shape)) == (dtype, shape), leaf
    stored = next(iter(declared.values()))[1][1]
    assert fmt.in_dim_of_stored(stored) == IN


@pytest.mark.parametrize("fmt", WEIGHT_FORMATS.values(), ids=WEIGHT_FORMATS)
def test_fake_quantize_is_dequantize_of_quantize(fmt):
    """The preview and the quality report compute with the weights the export writes, bit for bit."""
    w = torch.randn(OUT, IN, generator=torch.Generator().manual_seed(1)).bfloat16()
    scale = fmt.scale(abs_amax(w))
    for mse in (False, True):
        expected = fmt.dequantize(fmt.quantize(w, scale, mse), torch.bfloat16)
        assert torch.equal(fmt.fake_quantize_weight(w, scale, mse, torch.bfloat16), expected)


GPTQ_FORMATS = {n: f for n, f in WEIGHT_FORMATS.items() if "gptq" in f.algorithms}


@pytest.mark.parametrize("fmt", GPTQ_FORMATS.values(), ids=GPTQ_FORMATS)
def test_gptq_columns_round_to_what_the_export_encodes(fmt):
    """Rounding every column with the format's GPTQ columns gives values its codes hold exactly."""
    w_LOI = torch.randn(2, OUT, IN, generator=torch.Generator().manual_seed(2))
    scales = torch.stack([fmt.scale(abs_amax(x)) for x in w_LOI])
    cols = fmt.columns(w_LOI, scales)
    q = torch.stack([cols.round(j, w_LOI[:, :, j]) for j in range(IN)], dim=-1)
    assert torch.equal(cols.decode(cols.encode(q)), q)


def test_the_checkers_tell_the_formats_apart():
    """The checkers find a module's format by its ModelOpt tensors (the weight's dtype, the rank and
    dtype of its first scale, and its leaves: NVFP4 and NVFP4 weights only differ by input_scale, which
    the checks look up by the quant_algo the configs declare), its quant_algo and its compressed-tensors
    config group (format name, weights' strategy, quantized inputs or not, group size): each must name
    one format (INT4's grids aside). The ModelOpt signs only among the formats the ModelOpt layout holds (not INT4, MXFP4)."""
    # NVFP4 with its input scale pinned to 1 is stored as NVFP4 is, and read back as NVFP4
    pinned = [f for f in WEIGHT_FORMATS.values() if f.constant_input_amax is not None]
    assert [by_quant_algo(f.quant_algo) for f in pinned] == [WEIGHT_FORMATS["nvfp4"]] * len(pinned)
    modelopt = [f for f in WEIGHT_FORMATS.values() if f.modelopt_layout and f not in pinned]
    signs = {
        (f.modelopt_weight_dtype, f.modelopt_scale_rank, f.modelopt_scale_dtype, f.modelopt_leaves) for f in modelopt
    }
    assert len(signs) == len(modelopt)
    for fmt in modelopt:
        assert by_modelopt_weight_dtype(fmt.modelopt_weight_dtype, fmt.modelopt_scale_rank, [fmt]) is fmt
        assert by_quant_algo(fmt.quant_algo) is fmt
    # INT4 on the full grid is stored and decoded as on the Kimi grid (no config says a grid): read back as it
    regridded = {
        f: WEIGHT_FORMATS[f.name.removesuffix("_full")] for f in WEIGHT_FORMATS.values() if f.name.endswith("_full")
    }
    for fmt in (f for f in WEIGHT_FORMATS.values() if f not in pinned):
        inputs = fmt.modelopt_input_group() is not None
        assert by_ct_format(fmt.ct_format, fmt.ct_strategy, inputs, fmt.group_size) is regridded.get(fmt, fmt)
    # FP8 block and MXFP8 store an F8_E4M3 weight with a 2-D grid: fp32 scales or E8M0 bytes
    assert by_modelopt_weight_dtype("F8_E4M3", 2, scale_dtype="F32") is WEIGHT_FORMATS["fp8_block"]
    assert by_modelopt_weight_dtype("F8_E4M3", 2, scale_dtype="U8") is WEIGHT_FORMATS["mxfp8"]
    assert by_quant_algo(WEIGHT_FORMATS["mxfp4"].quant_algo) is None
    assert by_modelopt_weight_dtype("U8", 2, scale_dtype="U8") is not WEIGHT_FORMATS["mxfp4"]


def test_a_recipe_names_a_registered_format_or_none():
    assert FORMATS == (*WEIGHT_FORMATS, "none")
    with pytest.raises(
        ConfigError,
        match=r"format 'int3'; choose one of fp8, nvfp4, fp8_block, fp8_channel, nvfp4_a16, int4, int4_g32, w4a8, "
        r"mxfp8, mxfp4, nvfp4_input_scale1, int4_full, int4_g32_full, w4a8_full, none",
    ):
        parse_recipe({"quantize": [{"pattern": "*", "format": "int3"}]}, "r.yaml")
