"""`mse` for the formats whose only scales are a grid of block or row scales (FP8 block and per
channel, MXFP8, MXFP4; eprt.quant.formats.block_mse), on a weight built to be hostile in bf16,
fp16 and fp32: partial edge blocks, a zero block and a zero row, -0.0, one huge outlier per block,
values beneath the formats' normals and the dtype's own subnormals, blocks of exact values.

- The export's tensors under mse are max's set (leaves, dtypes, shapes); decoded by the export's
  own decoder, every cell (block, row) is at most max's error, the whole weight strictly below
  it, and a cell max quantizes exactly keeps max's scale where another candidate ties it.
- The codes are the export's encoding of their own decoded values under the searched scales.
- The search gives the same grid a chunk of rows at a time as whole, and for a stack of weights
  each one's own.
- A NaN is refused by name, as under max.
- A mixed recipe of all four formats exports data-free under mse (`--recipe ... --algorithm
  mse`) in the compressed-tensors layout with max's tensor names, dtypes and shapes, the scales
  of FP8 block and per channel and MXFP4 moved somewhere, and eprt-check passes it.
"""

from fnmatch import fnmatchcase

import pytest
import torch
import yaml

from eprt.hf.check_export import check_export
from eprt.hf.export import export_hf
from eprt.quant.formats import block_mse, weight_format
from tests.formats_helpers import tiny_checkpoint
from tests.hf_utils import read_hf_tensors

FORMATS = ("fp8_block", "fp8_channel", "mxfp8", "mxfp4")
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# rows x columns of a cell of each grid; None: the whole row
CELLS = {"fp8_block": (128, 128), "fp8_channel": (1, None), "mxfp8": (1, 32), "mxfp4": (1, 32)}
OUT, IN = 200, 288  # FP8 block's grid ends in a 72-row and a 32-column partial block; 9 MX blocks a row


def hostile(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(OUT, IN, generator=g) * 0.05
    w[:64].view(64, IN // 32, 32)[torch.arange(64), :, torch.arange(64) % 32] = 8 + torch.rand(
        64, IN // 32, generator=g
    )
    w[64:96] *= 1e-6  # beneath E4M3's normals under their FP8 block's outliers
    # each MX block: its top at 225 x 2^-10 and the rest at 3 x 2^-20, beneath E4M3's normals
    w[96] = 3 * 2.0**-20
    w[96, ::32] = 225 * 2.0**-10
    w[97] = torch.finfo(dtype).tiny * torch.rand(IN, generator=g)  # the dtype's subnormals
    # +-0.25: exact under max's scale and under 1.75 x its amax (FP8), a tie max's scale keeps
    w[128:, :128] = 0.25 * torch.randint(0, 2, (OUT - 128, 128), generator=g).mul(2).sub(1)
    w[:128, 256:] = 0  # a zero block (a partial one), zero MX blocks
    w[150] = 0
    w[151] = -0.0
    w[::7, ::5] = -0.0
    return w.to(dtype)


def cell_errors(fmt: str, t: dict[str, torch.Tensor], w: torch.Tensor) -> torch.Tensor:
    """float64 squared error of each cell of the grid of `fmt`'s tensors t against w, decoded by
    the export's own decoder, one cell at a time."""
    err = (weight_format(fmt).dequantize(t, torch.float64) - w.double()).square()
    height, width = CELLS[fmt]
    width = width or IN
    return torch.tensor(
        [[err[r : r + height, c : c + width].sum().item() for c in range(0, IN, width)] for r in range(0, OUT, height)],
        dtype=torch.float64,
    )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", FORMATS)
def test_mse_is_never_above_max_in_a_cell_and_below_it_in_all(name, dtype):
    fmt, w = weight_format(name), hostile(dtype)
    scale = fmt.scale(w.abs().amax().float())
    by_max, by_mse = fmt.quantize(w, scale, False), fmt.quantize(w, scale, True)
    want = fmt.modelopt_tensors(OUT, IN)
    assert {k: (v.dtype, tuple(v.shape)) for k, v in by_mse.items()} == want
    assert {k: (v.dtype, tuple(v.shape)) for k, v in by_max.items()} == want
    err_max, err_mse = cell_errors(name, by_max, w), cell_errors(name, by_mse, w)
    assert (err_mse <= err_max).all()
    assert err_mse.sum() < err_max.sum()
    # where max is exact, another candidate can at best tie it: the cell keeps max's scale
    exact = (err_max == 0).reshape(-1)
    assert exact.any() and (err_mse.reshape(-1)[exact] == 0).all()
    cells = lambda t: t["weight_scale"].reshape(exact.numel(), -1)  # noqa: E731
    assert torch.equal(cells(by_mse)[exact], cells(by_max)[exact])
    # the codes are what the export's encoder makes of their decoded values under the searched scales
    decoded = fmt.dequantize(by_mse, torch.float32)
    assert torch.equal(
        fmt.encode(decoded, by_mse["weight_scale"]).view(torch.uint8), by_mse["weight"].view(torch.uint8)
    )


@pytest.mark.parametrize("name", FORMATS)
def test_the_search_is_the_same_in_chunks_of_rows_and_for_a_stack(name, monkeypatch):
    fmt, w = weight_format(name), hostile(torch.bfloat16)
    whole = block_mse.mse_grid(fmt, w)
    monkeypatch.setattr(block_mse, "MSE_CHUNK_ELEMENTS", 3000)  # FP8 block: 2 chunks of rows; MX: 20
    assert torch.equal(block_mse.mse_grid(fmt, w), whole)
    stacked = block_mse.mse_grid(fmt, torch.stack([w, w.flip(0)]))
    assert torch.equal(stacked, torch.stack([whole, block_mse.mse_grid(fmt, w.flip(0))]))


@pytest.mark.parametrize("name", FORMATS)
def test_mse_refuses_a_nan_by_name(name):
    w = hostile(torch.float32)
    w[3, 7] = float("nan")
    fmt = weight_format(name)
    with pytest.raises(ValueError, match=r"tensor of shape \(200, 288\) holds NaN or infinite values"):
        fmt.quantize(w, fmt.scale(torch.tensor(1.0)), True)


# every format of the four on the tiny Qwen3-MoE, each on both kinds of weight somewhere
MIX = [
    ("model.layers.0.*", "mxfp8"),
    ("*.experts", "mxfp4"),
    ("*.self_attn.*", "fp8_block"),
    ("*", "fp8_channel"),
]


def format_of(module: str) -> str:
    """The format MIX gives a Hugging Face module (a routed expert's under the rule's `...experts`)."""
    return next(f for p, f in MIX if fnmatchcase(module, p) or fnmatchcase(module, p + ".*"))


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(source, {algorithm: the mix's data-free compressed-tensors export}) of the tiny Qwen3-MoE."""
    d = tmp_path_factory.mktemp("mse_blocks")
    hf, ck = tiny_checkpoint(d)
    recipe = d / "mix.yaml"
    recipe.write_text(yaml.safe_dump({"name": "mix", "quantize": [{"pattern": p, "format": f} for p, f in MIX]}))
    return hf, {
        a: export_hf(ck, str(d / a), progress=False, fmt="compressed-tensors", recipe=str(recipe), algorithm=a)
        for a in ("max", "mse")
    }


def test_a_mixed_recipe_exports_data_free_under_mse_and_passes_the_check(mixed):
    hf, out = mixed
    assert check_export(out["mse"], hf) == []
    by_max, by_mse = read_hf_tensors(out["max"]), read_hf_tensors(out["mse"])
    assert {n: (t.dtype, t.shape) for n, t in by_mse.items()} == {n: (t.dtype, t.shape) for n, t in by_max.items()}
    moved = {
        format_of(n.removesuffix(".weight_scale"))
        for n in by_mse
        if n.endswith(".weight_scale") and not torch.equal(by_mse[n], by_max[n])
    }
    # MXFP8's one other candidate wins only with values beneath E4M3's normals, which it lacks
    assert {"fp8_block", "fp8_channel", "mxfp4"} <= moved
