"""Quantization takes routed experts of any pieces: the preview's fake quantization and GPTQ run on
experts that are not gated (relu^2, one projection per row) and on biased clamped-SwiGLU experts
stored transposed and interleaved, converted from their source as a family would declare them."""

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from eprt.hf.convert import convert_hf
from eprt.layout import ExpertPieces
from eprt.models.decoder import Block, DecoderLayer
from eprt.models.layers import RMSNorm
from eprt.models.moe import Experts, MoE
from eprt.models.router import SoftmaxRouter
from eprt.parallel.state import ParallelState
from eprt.quant.algorithms.awq.groups import layer_groups
from eprt.quant.algorithms.gptq.layer import GPTQRun, LayerGPTQ
from eprt.quant.calibrated import CalibrationRecord
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.preview import fake_quantize
from eprt.quant.recipe import load_recipe
from eprt.quant.scales import Scales
from eprt.storage.checkpoint import Checkpoint
from tests.test_expert_storage import CASES, E, H, I, P, layer_layout, source_tensors, write_source  # noqa: F401

PREFIX = "model.layers.0."
SHAPES = ["biased, fused, transposed, interleaved", "not gated, per expert"]


def converted(tmp_path, layer_layout, case: str) -> tuple[str, Experts]:  # noqa: F811
    """The case's source converted, and eprt's experts holding it in fp32."""
    pieces, storage = CASES[case]
    layer_layout(pieces, storage)
    ck = convert_hf(
        write_source(str(tmp_path / "hf"), source_tensors(pieces, storage)), str(tmp_path / "ck"), progress=False
    )
    experts = Experts(E, 0, E, H, I, pieces=pieces)
    with Checkpoint(ck) as c, torch.no_grad():
        for name, p in experts.named_parameters():
            p.copy_(c.read(f"{P}.{name}").float())
    return ck, experts


def layer_of(experts: Experts) -> nn.Module:
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.experts = experts
    return layer


def routed_rows(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows sorted by expert in two work units each, every expert reached."""
    g = torch.Generator().manual_seed(seed)
    units = torch.randint(20, 40, (E, 2), generator=g)
    return torch.randn(int(units.sum()), H, generator=g), units


def calibrated(layer: nn.Module, x: torch.Tensor, units: torch.Tensor) -> Calibrator:
    cal = Calibrator(None, [P], kv=False)
    with cal.observing(layer, PREFIX), torch.no_grad():
        layer.mlp.experts.forward_units(x, units)
    return cal


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8_block"])
@pytest.mark.parametrize("case", SHAPES)
def test_fake_quantization_quantizes_each_projection_of_any_pieces(tmp_path, layer_layout, case, recipe):  # noqa: F811
    """Each stacked projection is its format's quantize-dequantize of each expert's row (gate and
    up apart where blocks span rows), under that row's scale; biases stay as they are; the inputs
    of both projections go through their input scales."""
    ck, experts = converted(tmp_path, layer_layout, case)
    x, units = routed_rows()
    layer = layer_of(experts)
    cal = calibrated(layer, x, units)
    before = {n: p.detach().clone() for n, p in experts.named_parameters()}
    r = load_recipe(recipe)
    seen = {}
    undo = fake_quantize(
        layer, [P], r, cal, ParallelState.single("cpu"), prefix=PREFIX, on_weight=lambda n, w: seen.setdefault(n, w)
    )
    first, down = experts.pieces.leaves
    assert set(seen) == {f"{P}.{first}", f"{P}.{down}"}
    scales = Scales({P: r.format_of(P)}, CalibrationRecord.of(cal), lambda m: None)
    for leaf, fan in ((first, experts.pieces.fan), (down, 1)):
        w, got = before[leaf], getattr(experts, leaf).detach()
        for e in range(E):
            scale = scales.expert_weight_scale(P, w[e])
            want = scales.fake_quantize_weight(P, w[e], scale, w.dtype, fan)
            assert torch.equal(got[e], want), (leaf, e)
            if fan > 1:  # gate and up quantized apart: the same as each alone, under the row's scale
                for half, got_half in zip(w[e].chunk(fan), got[e].chunk(fan)):
                    assert torch.equal(got_half, scales.fake_quantize_weight(P, half, scale, w.dtype)), (leaf, e)
        assert not torch.equal(got, w)
    for name in before:
        if name.endswith("_bias"):
            assert torch.equal(getattr(experts, name), before[name])
    with torch.no_grad():
        y = experts.forward_units(x, units)
    undo()
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("case", SHAPES)
def test_gptq_on_experts_of_any_pieces_beats_round_to_nearest(tmp_path, layer_layout, case):  # noqa: F811
    ck, experts = converted(tmp_path, layer_layout, case)
    x, units = routed_rows()
    layer = layer_of(experts)
    hs = {}  # the activation each expert's down reads, from the original weights
    experts.taps.units = lambda x_, h, rows: hs.setdefault("h", h.detach().clone())
    with torch.no_grad():
        experts.forward_units(x, units)
    experts.taps.units = None
    original = {n: p.detach().clone() for n, p in experts.named_parameters()}
    cal = calibrated(layer, x, units)
    r = load_recipe("nvfp4", algorithm="gptq")
    with Checkpoint(ck) as c:
        rc = SimpleNamespace(ck=c, dtype=torch.float32, source_tensor=lambda n: n, mtp_stacked={})
        run = GPTQRun(ParallelState.single("cpu"), rc, r, [P], tokens=int(units.sum()), min_tokens=1)
        gptq = LayerGPTQ(run, layer, PREFIX, cal)
        with gptq.observing(), torch.no_grad():
            experts.forward_units(x, units)
        gptq.quantize()
        scales = Scales.of_checkpoint(c, {P: r.format_of(P)}, CalibrationRecord.of(cal))
    codes = run.results.experts[P]
    assert len(codes) == 2 and all(t.shape[0] == E for t in codes) and run.results.skipped[P] == []
    first, down = experts.pieces.leaves
    ends = torch.cumsum(units.sum(1), 0).tolist()
    for leaf, fan, rows in ((first, experts.pieces.fan, x), (down, 1, hs["h"])):
        w, q = original[leaf], getattr(experts, leaf).detach()
        gptq_err = rtn_err = 0.0
        for e, (a, b) in enumerate(zip([0, *ends[:-1]], ends)):
            rtn = scales.fake_quantize_weight(P, w[e], scales.expert_weight_scale(P, w[e]), w.dtype, fan)
            gptq_err += (rows[a:b] @ (q[e] - w[e]).T).square().sum().item()
            rtn_err += (rows[a:b] @ (rtn - w[e]).T).square().sum().item()
        assert gptq_err < rtn_err, (leaf, gptq_err, rtn_err)


@pytest.mark.parametrize("case", ["gated", *SHAPES])
def test_awq_balances_only_the_experts_its_search_models(case):
    """AWQ's search models gated experts without biases; others are left out by name, quantized without AWQ."""
    pieces = ExpertPieces() if case == "gated" else CASES[case][0]

    moe = MoE(SoftmaxRouter(E, H, 2, True), Experts(E, 0, E, H, I, pieces=pieces))
    layer = DecoderLayer((Block("post_attention_layernorm", "mlp"), RMSNorm(H, 1e-6), moe))
    groups, left_out = layer_groups(layer, PREFIX)
    if case == "gated":
        assert [g.what for g in groups] == ["MoE input", "routed experts' activation"] and left_out == []
    else:
        assert groups == [] and left_out == [
            f"{P} (input and activation: the search models gated experts without biases)"
        ]


@pytest.mark.parametrize("case", SHAPES)
def test_the_quality_probe_measures_experts_of_any_pieces_against_their_own_output(tmp_path, layer_layout, case):  # noqa: F811
    """The quality report's expert probe recomputes each unit from the original weights with the
    experts' own pieces (activation, biases): unchanged weights have no error, changed ones do."""
    from eprt.quant.quality import ModuleErrors, _expert_probe

    _, experts = converted(tmp_path, layer_layout, case)
    x, units = routed_rows()
    errors = ModuleErrors(num_units=2)
    experts.taps.units_output = _expert_probe(P, experts, errors)
    with torch.no_grad():
        experts.forward_units(x, units)
        _, sums = errors.experts[P]
        err, ref, rows = sums
        assert torch.equal(err, torch.zeros_like(err)) and (ref > 0).all() and torch.equal(rows, units.double())
        experts.w_out.mul_(1.01)  # what a quantized down would change
        sums.zero_()
        experts.forward_units(x, units)
        assert (sums[0] > 0).all()
