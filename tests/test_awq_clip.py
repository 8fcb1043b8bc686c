"""AWQ's clipping search: each block's step is the one of least output error over the inputs, it
beats max's rounding where a block has an outlier, never clips the block that sets NVFP4's
weight_scale_2, and the fold writes what the search scored."""

import pytest
import torch

from eprt.quant.awq_clip import MOST_STEPS, block_errors, clip_steps, reader_hessian
from eprt.quant.awq_folds import CLIP, CLIP_GRID, COLUMNS, Folds, clipped
from eprt.quant.formats import weight_format
from eprt.quant.gptq import DAMP, HessianSum
from eprt.quant.numerics import abs_amax


@pytest.fixture(scope="module")
def case():
    """Inputs with correlated channels, a bf16 weight whose blocks each hold one large element."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(256, 64, generator=g) @ (torch.eye(64) + 0.3 * torch.randn(64, 64, generator=g))
    w = torch.randn(24, 64, generator=g) * 0.02
    w.view(24, -1, 16)[:, :, 0] *= 6  # an outlier per block: max's scale wastes the grid on it
    x[:, ::16] *= 0.05  # on a channel the inputs barely reach: clipping it costs little
    return x, w.bfloat16()


@pytest.mark.parametrize("name", ["nvfp4", "int4_g32"])
def test_each_block_takes_the_step_of_least_output_error(case, name):
    x, w = case
    fmt = weight_format(name)
    size = fmt.group_size
    hs = HessianSum(64, x.abs().max().item(), x.shape[0], block=size)
    hs.add(x)
    h = hs.hessian()
    full = x.double().T @ x.double()
    blocks = torch.stack([full[i : i + size, i : i + size] for i in range(0, 64, size)])
    assert torch.allclose(h, blocks, rtol=1e-12, atol=0)  # the input Hessian's diagonal blocks
    s = torch.rand(64, generator=torch.Generator().manual_seed(1)) + 0.5
    h = reader_hessian(hs.hessian(), s)
    # the folded reader's input x / s, damped by GPTQ's share of its mean diagonal
    xs = x.double() / s.double()
    blocks = torch.stack([(xs.T @ xs)[i : i + size, i : i + size] for i in range(0, 64, size)])
    damping = DAMP * torch.diagonal(blocks, dim1=-2, dim2=-1).mean()
    assert torch.allclose(h, blocks + damping * torch.eye(size, dtype=torch.float64), rtol=1e-10, atol=0)
    amax = abs_amax(w)
    kept = amax if fmt.weight_scale_leaf is not None else None
    steps = clip_steps(fmt, w, fmt.scale(amax), h, kept)
    # every block's error at every step, the weight clipped whole at each
    errors = torch.stack(
        [
            block_errors(
                w.float()
                - fmt.fake_quantize_weight(
                    clipped(w, torch.full_like(steps, k)), fmt.scale(amax), False, torch.float32
                ),
                h,
            )
            for k in range(MOST_STEPS)
        ]
    )
    chosen = errors.gather(0, steps.long()[None])[0]
    movable = w.float().view(24, -1, size).abs().amax(-1) < amax if kept is not None else torch.ones_like(chosen).bool()
    assert torch.equal(chosen[movable], errors.amin(0)[movable])
    assert (steps[~movable] == 0).all()
    if kept is not None:  # where the block holding the amax would clip, were it free to
        assert (clip_steps(fmt, w, fmt.scale(amax), h, None)[~movable] > 0).all()
    # the clip moves most blocks off max's scale and lowers the whole output error below max's
    assert (steps > 0).float().mean() > 0.25
    assert chosen.sum() < 0.95 * errors[0].sum()
    q = fmt.quantize(clipped(w, steps), fmt.scale(abs_amax(clipped(w, steps))), False)
    if kept is not None:  # the per-tensor scale is max's
        assert torch.equal(q[fmt.weight_scale_leaf], fmt.scale(amax))


def test_the_fold_clips_after_the_scales_and_gptq_reads_without_the_clip(case):
    _, w = case
    s = torch.rand(64, generator=torch.Generator().manual_seed(2)) + 0.5
    steps = torch.randint(0, MOST_STEPS, (24, 4), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    folds = Folds()
    folds.add("m", CLIP, steps)
    folds.add("m", COLUMNS, s)
    scaled = (w.float() * s).bfloat16()
    assert torch.equal(folds.apply("m.weight", w, clip=False), scaled)
    out = folds.apply("m.weight", w)
    bound = scaled.float().view(24, 4, 16).abs().amax(-1) * (1 - steps.float() / CLIP_GRID)
    assert torch.equal(out.float().view(24, 4, 16).abs().amax(-1), bound.bfloat16().float())
    inside = scaled.float().view(24, 4, 16).abs() <= bound[..., None]
    assert torch.equal(out.view(24, 4, 16)[inside], scaled.view(24, 4, 16)[inside])
