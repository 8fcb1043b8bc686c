"""GPTQ (eprt.quant.gptq): exact layout-free Hessians, the solve in the export's numerics."""

import pytest
import torch

from eprt.quant.fp8 import fp8_scale, quantize_fp8, dequantize_fp8
from eprt.quant.gptq import HessianSum, columns_of, gptq
from eprt.quant.nvfp4 import dequantize_nvfp4, nvfp4_scale, quantize_nvfp4

SCALE = {"fp8": fp8_scale, "nvfp4": nvfp4_scale}


def correlated_inputs(n: int, dim: int, seed: int) -> torch.Tensor:
    """Rows with correlated features and a few large channels, as a Linear's inputs are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / dim**0.5 + torch.eye(dim)
    x = torch.randn(n, dim, generator=g) @ mix
    x[:, :4] *= 8
    return x


def round_to_nearest(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """The max path's weight: the export's encoding of w, dequantized."""
    scale = SCALE[fmt](w.abs().amax())
    if fmt == "fp8":
        return dequantize_fp8(quantize_fp8(w, scale), scale)
    return dequantize_nvfp4(*quantize_nvfp4(w, scale), scale)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_gptq_beats_round_to_nearest_and_is_representable(fmt):
    torch.manual_seed(0)
    w = torch.randn(48, 160) * 0.05
    x = correlated_inputs(600, 160, seed=1)
    hs = HessianSum(160, x.abs().max().item(), x.shape[0])
    hs.add(x)
    cols = columns_of(fmt, w, SCALE[fmt](w.abs().amax()))
    q = gptq(w, hs.hessian(), cols, block=64)  # more than one lazy-batch block
    err = lambda wq: torch.linalg.norm(x @ wq.T - x @ w.T).item()  # noqa: E731
    assert err(q) < 0.9 * err(round_to_nearest(fmt, w)), (err(q), err(round_to_nearest(fmt, w)))
    # exactly representable: the export's encoder, under the scales fixed from w, gives codes
    # that decode to GPTQ's weight bit for bit
    codes = cols.encode(q)
    assert torch.equal(cols.decode(codes), q)
    if fmt == "nvfp4":  # the block scales are the export's, from the original weight
        assert torch.equal(cols.block_scale.view(torch.uint8),
                           quantize_nvfp4(w, SCALE[fmt](w.abs().amax()))[1].view(torch.uint8))


def test_gptq_zero_inputs_leave_dead_columns_zero():
    w = torch.randn(16, 32)
    x = correlated_inputs(64, 32, seed=2)
    x[:, 5] = 0  # a channel no token uses
    hs = HessianSum(32, x.abs().max().item(), 64)
    hs.add(x)
    q = gptq(w, hs.hessian(), columns_of("nvfp4", w, nvfp4_scale(w.abs().amax())))
    assert torch.all(q[:, 5] == 0)
    assert torch.isfinite(q).all()


def test_hessian_is_the_same_bits_for_any_split_of_the_units():
    """Units summed in any order, on any number of partial sums added later (the ranks and
    their all_reduce), give the same Hessian, where fp64 sums in those orders do not."""
    x = correlated_inputs(1000, 48, seed=3)  # fp32: products of bf16 values would sum exactly in fp64
    units = list(x.split([37, 1, 200, 90, 0, 300, 128, 244]))
    amax = x.abs().max().item()

    one = HessianSum(48, amax, x.shape[0])
    for u in units:
        one.add(u)
    split = [HessianSum(48, amax, x.shape[0]) for _ in range(3)]
    for i, u in enumerate(reversed(units)):
        split[i % 3].add(u)
    total = split[2].total + split[0].total + split[1].total
    assert torch.equal(one.total, total)
    # what the fixed point is for: plain fp64 partial sums depend on the order
    plain = lambda order: sum((u.double().T @ u.double() for u in order), torch.zeros(48, 48, dtype=torch.float64))  # noqa: E731
    assert not torch.equal(plain(units), plain(reversed(units)))
    # and it is the Hessian: within fp64's rounding of the partials
    want = x.double().T @ x.double()
    assert torch.allclose(one.hessian(), want, rtol=1e-12, atol=1e-9 * want.abs().max().item())


def test_hessian_refuses_rows_above_the_amax_it_was_sized_for():
    hs = HessianSum(4, 1.0, 10)
    with pytest.raises(ValueError, match="above the calibrated input amax"):
        hs.add(torch.tensor([[0.5, 2.0, 0.0, 0.0]]))
