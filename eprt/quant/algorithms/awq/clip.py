"""AWQ's clipping half (Lin et al., 2023, "auto_clip"): each quantization block of a weight chooses
how far to clip, by the error it makes in the output over the calibration inputs.

The weight is the one AWQ's scales were folded into (eprt.quant.algorithms.awq.folds); a block of `group_size`
consecutive input channels of one output row is clipped to (1 - k / CLIP_GRID) of its own amax,
k in 0 .. MOST_STEPS - 1 (the published grid: down to about half, in twentieths), and quantized by
the format's own rule (the block-amax rule: the clip moves the block's scale down, and the clipped
elements land on the largest code). Each block takes the k of least error

    e^T H_b e,   e = w_b - q_b (the block of the folded weight and its quantization),

H_b the block's diagonal block of its input's Hessian (sum of x x^T over the calibration rows, the
inputs divided by AWQ's scale as the folded reader reads them): the output error of that block's
contribution, cross terms between its channels included (the whole 16 x 16 or 32 x 32 block is
that error exactly and costs little more than its diagonal; the diagonal alone measured the same
within the noise on the bench model: docs/quality.md).
Blocks are independent under the block rule, so every block chooses its own k at once. Step 0 is
max's own rounding and wins ties, so the search never does worse than max by its own measure.

NVFP4's weight_scale_2 comes from the weight's amax (its fused siblings' too): a block that holds
that amax is never clipped, so weight_scale_2 stays max's. The Hessians are exact int64 sums
(eprt.quant.algorithms.gptq.solve.HessianSum), so every layout chooses the same steps. A damping of GPTQ's 1% of
the mean diagonal keeps a direction no calibration row reached from counting for nothing."""

from __future__ import annotations

import torch

from eprt.quant.algorithms.awq.folds import CLIP_GRID, clipped
from eprt.quant.algorithms.gptq.solve import DAMP
from eprt.quant.formats import WeightFormat

MOST_STEPS = CLIP_GRID // 2  # clip bounds from the block's amax down to 0.55 of it
# The search quantizes every step of a chunk of rows at once: about this many elements, which
# bound its working memory (a few fp32 and fp64 copies of them), not its result.
CHUNK_ELEMENTS = 1 << 22


def clips(fmt: WeightFormat) -> bool:
    """Whether AWQ clips weights of format `fmt`: 4-bit codes in blocks along the input dim, whose
    scale follows the block's amax."""
    return fmt.group_size is not None and fmt.num_bits == 4


def reader_hessian(total: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """The diagonal blocks [B, g, g] fp64 of the Hessian of x / s (a reader's input after AWQ's fold)
    from those of x (`total`), damped by DAMP of the mean diagonal."""
    sv = s.double().to(total.device).view(total.shape[0], -1)
    h = total / (sv[:, :, None] * sv[:, None, :])
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    damping = DAMP * diag.mean()
    return h + damping * torch.eye(h.shape[-1], dtype=h.dtype, device=h.device)


def block_errors(e: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """e_b^T H_b e_b [..., out, B] fp64 of the errors e [..., out, in] by the blocks' Hessians h [B, g, g]."""
    eb = e.double().view(*e.shape[:-1], h.shape[0], h.shape[1])
    return torch.einsum("...obi,bij,...obj->...ob", eb, h, eb)


def clip_steps(
    fmt: WeightFormat, w: torch.Tensor, w_scale: torch.Tensor, h: torch.Tensor, kept_amax: torch.Tensor | None
) -> torch.Tensor:
    """The step of least output error (uint8 [out, in / group_size]) of each block of weight w
    [out, in] (as the export quantizes it) under its per-tensor scale `w_scale`, the blocks' input
    Hessians h [B, g, g] (`reader_hessian`); a block whose amax reaches `kept_amax` (the per-tensor
    scale's amax, None where the format has none) keeps step 0. Every step is quantized in one call
    of the format's rule, a chunk of rows at a time (about CHUNK_ELEMENTS elements of candidates)."""
    out, width = w.shape
    blocks = width // fmt.group_size
    best = torch.empty(out, blocks, dtype=torch.uint8, device=w.device)
    steps = torch.arange(MOST_STEPS, dtype=torch.uint8, device=w.device).view(-1, 1, 1)
    rows = max(1, CHUNK_ELEMENTS // (MOST_STEPS * width))
    for a in range(0, out, rows):
        chunk = w[a : a + rows]
        ref = chunk.float()
        every = clipped(chunk.expand(MOST_STEPS, *chunk.shape), steps.expand(-1, chunk.shape[0], blocks))
        err = block_errors(ref - fmt.fake_quantize_weight(every, w_scale, False, torch.float32), h)
        if kept_amax is not None:  # the blocks that set the per-tensor scale: step 0 only
            kept = ref.view(chunk.shape[0], blocks, -1).abs().amax(-1) >= kept_amax.to(w.device)
            err[1:, kept] = torch.inf
        best[a : a + rows] = err.argmin(0).to(torch.uint8)  # argmin: the first of equal errors, step 0 first
    return best
