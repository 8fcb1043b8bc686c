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
- The export is the same bytes from two ranks at ep 2 as from one process.
- `mse` and `gptq` are refused for it by name.
"""

import json
import os
import shutil
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.layout import Layout
from eprt.parallel import ParallelState
from eprt.quant.feasibility import RecipeError, quantized_modules
from eprt.quant.formats.fp8_block import FP8_BLOCK, dequantize_fp8_block, fp8_block_scales, quantize_fp8_block
from eprt.quant.ptq import PTQArgs, run_ptq
from eprt.quant.recipe import parse_recipe
from eprt.testing.tiny import make_tiny
from tests.hf_utils import raw, read_hf_tensors
from tests.multiproc import run_world

HIDDEN = 192  # 128 + 64: a partial block along every hidden dim
# a whole block of rows for each of gate and up: ModelOpt's fused-experts export blocks w13 [2I, D]
# as one weight, where eprt (and the releases) block gate and up apart; the same blocks at I = 128
MOE_INTERMEDIATE = 128
SAMPLES, SEQ_LEN = 2, 16


def ptq(state: ParallelState, ck: str, out: str) -> None:
    run_ptq(
        state, PTQArgs(ck, "fp8_block", out, calib_size=SAMPLES, seq_len=SEQ_LEN, batch_size=SAMPLES, progress=False)
    )


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(source dir, eprt checkpoint, ModelOpt-layout export, compressed-tensors export)."""
    d = tmp_path_factory.mktemp("fp8_block")
    hf = make_tiny("qwen3_moe", str(d / "hf"), hidden_size=HIDDEN, moe_intermediate_size=MOE_INTERMEDIATE)
    ck = convert_hf(hf, str(d / "ck"), progress=False)
    q = str(d / "q")
    ptq(ParallelState.single(), ck, q)
    return (
        hf,
        ck,
        export_hf(q, q + "-modelopt", progress=False),
        export_hf(q, q + "-ct", progress=False, fmt="compressed-tensors"),
    )


def test_the_numerics_are_modelopts_block_quantizer():
    qtensor = pytest.importorskip("modelopt.torch.quantization.qtensor")
    w = torch.randn(2, 200, 300, generator=torch.Generator().manual_seed(0)).bfloat16()
    w[1, :128, :128] = 0  # a zero block: scale 1, codes 0
    scales = fp8_block_scales(w)
    assert scales.shape == (2, 2, 3)
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
        codes.float() * scales.repeat_interleave(128, 1)[:, :200].repeat_interleave(128, 2)[:, :, :300],
    )


def test_the_modelopt_export_is_modelopts(model, tmp_path):
    pytest.importorskip("modelopt")
    pytest.importorskip("transformers")
    import modelopt.torch.quantization as mtq
    from modelopt.torch.export import export_hf_checkpoint
    from transformers import AutoModelForCausalLM

    hf, _, ours_dir, _ = model
    torch_model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    # enough tokens that every expert is run (an expert ModelOpt's calibration never ran fails its export)
    tokens = torch.randint(0, 500, (16, 32), generator=torch.Generator().manual_seed(0))
    mtq.quantize(torch_model, mtq.FP8_2D_BLOCKWISE_WEIGHT_ONLY_CFG, lambda m: m(tokens))  # weights only
    export_hf_checkpoint(torch_model, export_dir=str(tmp_path / "modelopt"))
    theirs, ours = read_hf_tensors(str(tmp_path / "modelopt")), read_hf_tensors(ours_dir)
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
    their_q = json.loads((tmp_path / "modelopt" / "hf_quant_config.json").read_text())["quantization"]
    our_q = json.loads(Path(ours_dir, "hf_quant_config.json").read_text())["quantization"]
    assert their_q.pop("quant_algo") == "fp8_pb_wo" and our_q.pop("quant_algo") == "FP8_PB_WO"
    assert their_q == our_q


def test_compressed_tensors_decompresses_and_encodes_as_eprt(model):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import quantize

    hf, _, _, ct = model
    qc = QuantizationConfig.model_validate(json.loads(Path(ct, "config.json").read_text())["quantization_config"])
    (scheme,) = qc.config_groups.values()
    assert (scheme.weights.strategy, scheme.weights.block_structure) == ("block", [128, 128])
    assert (scheme.input_activations.strategy, scheme.input_activations.dynamic) == ("group", True)
    compressor = BaseCompressor.get_value_from_registry(scheme.format)
    t, source = read_hf_tensors(ct), read_hf_tensors(hf)
    modules = sorted(n[: -len(".weight_scale")] for n in t if n.endswith(".weight_scale"))
    assert any(".experts." in m for m in modules) and any("self_attn" in m for m in modules)
    for module in modules:
        codes, scales = t[f"{module}.weight"], t[f"{module}.weight_scale"]
        # each Linear's blocks its own (gate and up of an expert apart), as the numerics test checks them
        assert torch.equal(scales, fp8_block_scales(source[f"{module}.weight"])), module
        state = {leaf: t[f"{module}.{leaf}"] for leaf in compressor.compression_param_names(scheme)}
        assert torch.equal(
            compressor.decompress(state, scheme)["weight"].float(), dequantize_fp8_block(codes, scales)
        ), module
        theirs = quantize(
            source[f"{module}.weight"], scales, torch.zeros_like(scales), scheme.weights, dtype=torch.float8_e4m3fn
        )
        assert raw(theirs) == raw(codes), module


def test_check_passes_both_layouts(model):
    _, _, modelopt, ct = model
    assert check_export(modelopt) == []
    assert check_export(ct) == []


def broken_copy(src: str, dst: Path, name: str, edit) -> str:
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(str(f))
        if name in tensors:
            tensors[name] = edit(tensors[name])
            save_file(tensors, str(f), metadata={"format": "pt"})
    return str(dst)


def set_first(value: float):
    def edit(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        t.view(-1)[0] = value
        return t

    return edit


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
    _, _, modelopt, ct = model
    name = "model.layers.0.self_attn.q_proj.weight_scale"
    problems = check_export(broken_copy(modelopt if layout == "modelopt" else ct, tmp_path / "x", name, edit))
    assert any(p.startswith(name) and fault in p for p in problems), problems


def _ptq_ep2(ck: str, out: str) -> None:
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        ptq(state, ck, out)


def test_two_ranks_at_ep_2_export_the_same_bytes(model, tmp_path):
    _, ck, modelopt, _ = model
    run_world(_ptq_ep2, 2, ck, str(tmp_path / "q"), timeout=300)
    ours = export_hf(str(tmp_path / "q"), str(tmp_path / "export"), progress=False)
    names = sorted(os.listdir(modelopt))
    assert names == sorted(os.listdir(ours))
    for n in names:
        assert Path(modelopt, n).read_bytes() == Path(ours, n).read_bytes(), n


@pytest.mark.parametrize("algorithm", ["mse", "gptq"])
def test_mse_and_gptq_are_refused_by_name(model, algorithm):
    from eprt.families import reader_for
    from eprt.storage.checkpoint import Checkpoint

    _, ck, _, _ = model
    recipe = parse_recipe(
        {"name": "r", "quantize": [{"pattern": "*", "format": "fp8_block", "algorithm": algorithm}]}, "r.yaml"
    )
    with Checkpoint(ck) as c:
        layout: Layout = reader_for(c.config.model_type, ck).layout(c.config)
    with pytest.raises(
        RecipeError,
        match=rf"fp8_block with algorithm {algorithm}, which fp8_block does not "
        r"implement \(it runs max",
    ):
        quantized_modules(layout, recipe, ck)
    assert FP8_BLOCK.algorithms == ("max",)
