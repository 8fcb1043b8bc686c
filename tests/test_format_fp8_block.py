"""FP8 block (`format: fp8_block`) against references nobody here wrote, on a model whose hidden
size, 192, ends every weight of that dimension in a partial 64-wide block.

- The numerics: ModelOpt's own block quantizer (`FP8QTensor.quantize`, 128x128 blocks) gives the
  same codes and scales, partial blocks included.
- The ModelOpt layout: byte for byte ModelOpt 0.47's `export_hf_checkpoint` of its
  FP8_2D_BLOCKWISE_WEIGHT_ONLY config on the same model, but for two things ModelOpt 0.47 writes
  that no engine reads: it squeezes a grid's size-1 dims (a [1, 2] grid as [2]), where eprt keeps the
  [ceil(out/128), ceil(in/128)] grid the engines load (the values are compared); and its configs
  name the format by its internal `fp8_pb_wo` with no config_groups (its per-layer table has no
  entry for the format), where eprt writes FP8_PB_WO and the block and input-group arguments.
- The compressed-tensors layout: the library's own compressor decompresses every module to eprt's
  dequantized values exactly, and its quantizer, given eprt's block scales, encodes the source
  weights to eprt's codes. transformers 5.24 cannot load it on CPU: its fused-experts
  dequantization multiplies the codes by the scale grid without spreading the blocks (a shape
  error), so no transformers test is made here.
- eprt-check passes both layouts and refuses a zero, a NaN and a misshapen block scale in each.
- It warns where a Linear the engines fuse with a sibling (MLA's q_a_proj with kv_a_proj_with_mqa)
  has a row count that is not a multiple of 128, in either layout.
"""

import pytest
import torch

from eprt.hf.check_engine_quirks import engine_warnings
from eprt.hf.check_export import check_export
from eprt.quant.formats.fp8_block import dequantize_fp8_block, fp8_block_scales, quantize_fp8_block
from tests.formats_helpers import (
    broken_copy,
    ct_scheme,
    decompressed,
    export_format,
    modelopt_export,
    quant_config,
    set_first,
)
from tests.hf_utils import raw, read_hf_tensors

HIDDEN = 192  # 128 + 64: a partial block along every hidden dim
# a whole block of rows for each of gate and up: ModelOpt's fused-experts export blocks w13 [2I, D]
# as one weight, where eprt (and the releases) block gate and up apart; the same blocks at I = 128
MOE_INTERMEDIATE = 128


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return export_format(
        tmp_path_factory.mktemp("fp8_block"), "fp8_block", hidden_size=HIDDEN, moe_intermediate_size=MOE_INTERMEDIATE
    )


@pytest.mark.parametrize(
    "rows, cols", [(200, 300), (256, 384), (256, 2304)]
)  # partial last blocks, whole blocks only (in pieces of up to 16 blocks: 2304 is 16 + 2)
def test_the_numerics_are_modelopts_block_quantizer(rows, cols):
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    w = torch.randn(2, rows, cols, generator=torch.Generator().manual_seed(0)).bfloat16()
    w[1, :128, :128] = 0  # a zero block: scale 1, codes 0
    scales = fp8_block_scales(w)
    assert scales.shape == (2, -(-rows // 128), -(-cols // 128))
    codes = quantize_fp8_block(w, scales)
    for e in range(2):
        theirs, their_scales = qtensor.FP8QTensor.quantize(w[e], scales[e], block_sizes={-1: 128, -2: 128})
        assert raw(theirs._quantized_data) == raw(codes[e])
    # ModelOpt's scale, amax / 448, on every block with an amax
    amax_scales = qtensor.FP8QTensor.quantize(w[0].float(), block_sizes={-1: 128, -2: 128})[1]
    assert torch.equal(amax_scales, scales[0])
    assert scales[1, 0, 0] == 1.0 and not codes[1, :128, :128].view(torch.uint8).any()
    assert torch.equal(
        dequantize_fp8_block(codes, scales),
        codes.float() * scales.repeat_interleave(128, 1)[:, :rows].repeat_interleave(128, 2)[:, :, :cols],
    )


def test_the_modelopt_export_is_modelopts(model, tmp_path):
    mtq = pytest.importorskip("modelopt.torch.quantization")
    theirs_dir = modelopt_export(model.hf, mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG, tmp_path / "modelopt")  # weights only
    theirs, ours = read_hf_tensors(theirs_dir), read_hf_tensors(model.modelopt)
    assert set(theirs) == set(ours)
    partial = 0
    for name in sorted(theirs):
        a, b = theirs[name], ours[name]
        if name.endswith(".weight_scale"):  # ModelOpt squeezes the grid's size-1 dims
            assert b.shape == tuple(-(-n // 128) for n in ours[name[: -len("_scale")]].shape), name
            partial += b.numel() > 1
            a = a.reshape(b.shape)
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert raw(a) == raw(b), name
    assert partial  # the grids cover several blocks, the last of them partial
    their_q, our_q = (quant_config(d, "hf_quant_config.json") for d in (theirs_dir, model.modelopt))
    assert their_q.pop("quant_algo") == "fp8_pb_wo" and our_q.pop("quant_algo") == "FP8_PB_WO"
    assert their_q == our_q


def test_compressed_tensors_decompresses_and_encodes_as_eprt(model):
    scheme, compressor = ct_scheme(model.ct)
    from compressed_tensors.quantization.lifecycle.forward import quantize

    assert (scheme.weights.strategy, scheme.weights.block_structure) == ("block", [128, 128])
    assert (scheme.input_activations.strategy, scheme.input_activations.dynamic) == ("group", True)
    t, source = read_hf_tensors(model.ct), read_hf_tensors(model.hf)
    modules = sorted(n[: -len(".weight_scale")] for n in t if n.endswith(".weight_scale"))
    assert any(".experts." in m for m in modules) and any("self_attn" in m for m in modules)
    for module in modules:
        codes, scales = t[f"{module}.weight"], t[f"{module}.weight_scale"]
        # each Linear's blocks its own (gate and up of an expert apart), as the numerics test checks them
        assert torch.equal(scales, fp8_block_scales(source[f"{module}.weight"])), module
        assert torch.equal(decompressed(t, module, scheme, compressor).float(), dequantize_fp8_block(codes, scales)), (
            module
        )
        theirs = quantize(
            source[f"{module}.weight"], scales, torch.zeros_like(scales), scheme.weights, dtype=torch.float8_e4m3fn
        )
        assert raw(theirs) == raw(codes), module


def test_check_passes_both_layouts(model):
    assert check_export(model.modelopt) == []
    assert check_export(model.ct) == []


@pytest.mark.parametrize("layout", ["modelopt", "ct"])
@pytest.mark.parametrize(
    "edit, fault",
    [
        (set_first(0.0), "block scale(s) zero, negative or NaN"),
        (set_first(float("nan")), "block scale(s) zero, negative or NaN"),
        (set_first(1e-40), "subnormal"),
        (lambda t: t[:, :1].contiguous(), "expected"),
    ],
)
def test_check_refuses_a_corrupted_block_scale(model, tmp_path, layout, edit, fault):
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    problems = check_export(broken_copy(getattr(model, layout), tmp_path / "x", name, edit))
    assert any(p.startswith(name) and fault in p for p in problems), problems


# DeepSeek-V3's MLA with every fused group but kv_a_proj_with_mqa in whole 128-row blocks: q_a_proj
# 128 rows, the shared experts' and routed experts' gate/up 128, the dense MLP's 256
MLA_WHOLE_BLOCKS = dict(
    q_lora_rank=128, qk_rope_head_dim=16, intermediate_size=256, moe_intermediate_size=128, num_nextn_predict_layers=0
)


@pytest.mark.parametrize("kv_lora_rank, partial", [(128, True), (112, False)])
def test_check_warns_of_a_fused_linear_ending_in_a_partial_block_row(tmp_path, kv_lora_rank, partial):
    """kv_a_proj_with_mqa is kv_lora_rank + the rope dims rows (576 in DeepSeek-V3 and GLM-5): the
    engines fuse it with q_a_proj, stacking both block-scale grids, and one read the partial last
    row of GLM-5.3's wrongly. 128 + 16 rows end in a partial block, 112 + 16 do not."""
    model = export_format(tmp_path, "fp8_block", family="deepseek_v3", kv_lora_rank=kv_lora_rank, **MLA_WHOLE_BLOCKS)
    for out in (model.modelopt, model.ct):
        assert check_export(out) == []  # a warning, not a violation
        warnings = engine_warnings(out)
        if not partial:
            assert warnings == []
            continue
        (line,) = warnings
        layers = 3  # every layer of the tiny model has one
        assert line.startswith(f"{layers} fp8_block Linears the engines fuse with a sibling"), line
        assert "(model.layers.0.self_attn.kv_a_proj_with_mqa: 144 rows, fused with q_a_proj/kv_a_proj_with_mqa;" in line
        assert '{pattern: "*.kv_a_proj_with_mqa", format: fp8_channel}' in line
