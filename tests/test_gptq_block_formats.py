"""GPTQ for the block-scaled formats (FP8 block, FP8 per channel, MXFP8, MXFP4): the column
quantizer (eprt.quant.formats.block_columns) against the export's own encoding, GPTQ's output error
against max rounding's, and a GPTQ run of the four formats in one recipe exported and checked."""

from fnmatch import fnmatch

import pytest
import torch
import yaml

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.algorithms.gptq.solve import HessianSum, columns_of, gptq
from eprt.quant.formats import WEIGHT_FORMATS
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.hf_utils import read_hf_tensors
from tests.test_gptq import correlated_inputs

# (rows, columns) of each format's hostile weight: partial 128x128 blocks for FP8 block (two pieces
# of 100 rows, each ending in a partial block), whole groups of 32 for the MX formats
SHAPES = {"fp8_block": (200, 200), "fp8_channel": (40, 72), "mxfp8": (40, 96), "mxfp4": (40, 96)}
PIECES = 2  # the rows hold two weights end to end, as a routed expert's w13 holds gate and up


def bits(t: torch.Tensor) -> torch.Tensor:
    """fp32 t's bits: -0.0 and 0.0 apart."""
    return t.float().contiguous().view(torch.int32)


def hostile(name: str) -> torch.Tensor:
    """A stack of two bf16 weights [2, rows, cols] with the values a grid must survive: a zero
    block (its first 128 x 128, 100 x 128 or 32 x 32 corner of the first piece), a block of -0.0,
    a zero row, rows of very different magnitudes and values far below their block's amax."""
    out, cols = SHAPES[name]
    g = torch.Generator().manual_seed(7)
    w = torch.randn(2, out, cols, generator=g) * torch.logspace(-3, 1, out)[:, None]
    corner = (100, 128) if name == "fp8_block" else (out, cols) if name == "fp8_channel" else (32, 32)
    w[0, : corner[0], : corner[1]] = 0.0
    w[1, : corner[0], : corner[1]] = -0.0
    w[1, -1] = 0.0
    w[:, 2, 5] = -1e-30  # below every scale: a code of zero, which keeps its sign
    return w.bfloat16()


def export_weight(fmt, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """The export's tensors of one weight of `hostile`'s stack."""
    return fmt.quantize_stacked(w, fmt.scale(w.abs().amax()), False, PIECES)


@pytest.mark.parametrize("name", SHAPES)
def test_columns_round_encode_and_decode_as_the_export(name):
    fmt = WEIGHT_FORMATS[name]
    w = hostile(name)
    cols = columns_of(name, w, torch.ones(2), PIECES)
    # every column rounded alone (no error to spread) is max rounding: the export's values and codes
    q = torch.stack([cols.round(j, w[:, :, j].double()) for j in range(w.shape[-1])], dim=-1)
    exported = [export_weight(fmt, x) for x in w]
    assert torch.equal(bits(q), bits(torch.stack([fmt.dequantize_stacked(t, torch.float32, PIECES) for t in exported])))
    codes = cols.encode(q)
    assert torch.equal(codes.view(torch.uint8), torch.stack([t["weight"] for t in exported]).view(torch.uint8))
    assert torch.equal(bits(cols.decode(codes)), bits(q))
    assert (bits(q) == -(2**31)).any()  # -0.0 made it through
    # GPTQ moves the largest value of a block beyond the block's amax: it saturates under the
    # original scale and stays exactly representable, its codes the same once decoded and encoded
    j = int(w[0].float().abs().amax(dim=0).argmax())
    moved = q.clone()
    moved[:, :, j] = cols.round(j, 3 * w[:, :, j].double() + 0.01)
    assert torch.equal(bits(cols.round(j, moved[:, :, j].double())), bits(moved[:, :, j]))
    again = cols.encode(cols.decode(cols.encode(moved)))
    assert torch.equal(again.view(torch.uint8), cols.encode(moved).view(torch.uint8))
    assert torch.equal(bits(cols.decode(again)), bits(moved))
    saturated = fmt.largest_code(None) * cols.row_scales[:, :, j // cols.width]
    assert (moved[:, :, j].abs() == saturated).any() and (moved[:, :, j].abs() <= saturated).all()


@pytest.mark.parametrize("name", SHAPES)
def test_gptq_output_error_is_below_max_rounding(name):
    """A property of the method: on correlated inputs GPTQ's ||(W - Q) X|| is well below max
    rounding's (the export's encoding of W); broken columns lose it."""
    fmt = WEIGHT_FORMATS[name]
    w = torch.randn(1, 64, 128, generator=torch.Generator().manual_seed(3)) * 0.05
    x = correlated_inputs(400, 128, seed=4)
    hs = HessianSum(128, x.abs().max().item(), x.shape[0])
    hs.add(x)
    q = gptq(w, hs.hessian()[None], columns_of(name, w, torch.ones(1), PIECES), block=64)
    rtn = fmt.dequantize_stacked(export_weight(fmt, w[0]), torch.float32, PIECES)
    err = lambda wq: torch.linalg.norm(x @ wq.T - x @ w[0].T).item()  # noqa: E731
    assert err(q[0]) < 0.8 * err(rtn), (err(q[0]), err(rtn))


MIX = [
    ("*.experts", "fp8_block"),  # w13's gate and up (32 rows each) in blocks of their own
    ("*.self_attn.o_proj", "fp8_channel"),
    ("*.self_attn.*", "mxfp4"),
    ("*.mlp.*", "mxfp8"),
    ("*", "none"),
]


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(source, GPTQ's export, max's export) of a tiny Qwen3-MoE under MIX, compressed-tensors' layout."""
    d = tmp_path_factory.mktemp("gptq-blocks")
    hf = make_tiny("qwen3_moe", str(d / "hf"), dtype="bf16")
    ck = convert_hf(hf, str(d / "ck"), progress=False)
    recipe = d / "mix.yaml"
    recipe.write_text(yaml.safe_dump({"name": "mix", "quantize": [{"pattern": p, "format": f} for p, f in MIX]}))
    args = dict(calib_size=8, seq_len=32, gptq_min_tokens=16, progress=False)
    run_ptq(ParallelState.single(), PTQArgs(ck, str(recipe), str(d / "q"), algorithm="gptq", **args))
    gptq_out = export_hf(str(d / "q"), str(d / "gptq"), progress=False, fmt="compressed-tensors")
    max_out = export_hf(ck, str(d / "max"), progress=False, fmt="compressed-tensors", recipe=str(recipe))
    return hf, gptq_out, max_out


def format_of(tensor: str) -> str:
    """The format MIX gives the module of an exported tensor (a routed expert's: its experts module's)."""
    module = tensor.rsplit(".", 1)[0]
    return next(f for p, f in MIX if fnmatch(module, p) or fnmatch(module, p + ".*"))


def test_a_gptq_run_of_the_block_formats_exports_and_passes_the_checks(exports):
    """GPTQ writes its codes beside the scales max writes (the grids come from the original
    weights): every tensor of max's export is there, each the same bytes but the codes, each
    format's codes GPTQ's (not max's), and the checks pass it."""
    hf, gptq_out, max_out = exports
    assert check_export(gptq_out, hf) == []
    got, want = read_hf_tensors(gptq_out), read_hf_tensors(max_out)
    assert set(got) == set(want)
    codes = {n for n in want if n.endswith(("_proj.weight", "_proj.weight_packed")) and format_of(n) != "none"}
    assert {format_of(n) for n in codes} == {f for _, f in MIX} - {"none"}
    for n, t in want.items():
        if n not in codes:
            assert torch.equal(got[n].view(torch.uint8), t.view(torch.uint8)), n
    for f in {format_of(n) for n in codes}:
        changed = [
            n
            for n in codes
            if format_of(n) == f and not torch.equal(got[n].view(torch.uint8), want[n].view(torch.uint8))
        ]
        assert changed, f
