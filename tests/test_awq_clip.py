"""AWQ's clipping search: each block's step is the one of least output error over the inputs, it
beats max's rounding where a block has an outlier, never clips the block that sets NVFP4's
weight_scale_2, and the fold writes what the search scored."""

from types import SimpleNamespace

import pytest
import torch

from eprt.models.moe import Experts
from eprt.parallel import ParallelState
from eprt.quant.algorithms.awq.clip import MOST_STEPS, block_errors, clip_steps, reader_hessian
from eprt.quant.algorithms.awq.folds import CLIP, CLIP_GRID, COLUMNS, W13_CLIP, FoldedCheckpoint, Folds, clipped
from eprt.quant.algorithms.awq.passes import AWQ
from eprt.quant.algorithms.gptq.solve import DAMP, HessianSum
from eprt.quant.formats import weight_format
from eprt.quant.loop.calibrate import Calibrator
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


def clip_experts(w13: torch.Tensor, x: torch.Tensor):
    """AWQ's clip search of the w13 of routed experts 2 and 3 of 4 (this rank's), each reading x;
    (the tensor it changes, the run's folds after it)."""
    layer = torch.nn.Module()
    layer.experts = Experts(4, 2, 2, w13.shape[2], w13.shape[1] // 2)
    layer.experts.w13.data = w13
    awq = AWQ(
        Calibrator(None, ["experts"], kv=False), SimpleNamespace(format_of=lambda _: "nvfp4"), Folds(2), writes=False
    )
    work = SimpleNamespace(module=layer, prefix="", state=ParallelState.single())
    changed = awq._clip_experts(work, "experts", W13_CLIP, lambda ex: ex.w13, [[x], [x]], torch.ones(w13.shape[2]))
    return changed, awq.folds


def test_a_rank_holds_its_own_experts_clips_and_none_where_no_block_clips(case):
    """The routed experts' clips are this rank's experts' rows only (read by the experts' ids, a
    read of another rank's refused); experts no block of which clips (every block reaching its
    row's amax, which NVFP4's per-tensor scale keeps) leave no fold and change no tensor."""
    x, w = case
    w13 = torch.stack([w[:16], w[8:]])  # [2, 16, 64]: gate and up of 8 rows each
    changed, folds = clip_experts(w13, x)
    (steps,) = folds.tensors().values()
    assert changed == "experts.w13" and steps.shape == (2, 16, 4) and steps.any()
    clipped_w13 = FoldedCheckpoint(SimpleNamespace(read=lambda _n, rows: w13[rows[0] - 2 : rows[1] - 2]), folds)
    for e in (2, 3):
        assert torch.equal(clipped_w13.read("experts.w13", (e, e + 1))[0], clipped(w13[e - 2], steps[e - 2]))
    with pytest.raises(ValueError, match=r"rows \[1, 2\) .* held for experts \[2, 4\)"):
        folds.apply("experts.w13", w13[:1], (1, 2))
    flat = torch.where(w13 < 0, -1.0, 1.0).mul(0.02).bfloat16()  # every block holds its row's amax
    changed, folds = clip_experts(flat, x)
    assert changed is None and folds.tensors() == {}
