"""A glance at the model before and after quantization: a short greedy continuation of a prompt.

After calibration the quantized modules are fake-quantized in place (weights quantized and
dequantized with the export's scales, inputs through their calibrated input scale, the KV
cache through its k/v scales), so the continuation shows what the engine will compute. The
model is not used afterwards: export reads the weights from the checkpoint. The quality report
(eprt.quant.quality) and GPTQ's quantized stream (eprt.quant.algorithms.gptq.layer) fake-quantize each
decoder layer the same way, the weights GPTQ chose in place of max's or mse's.
"""

from __future__ import annotations

import contextlib
import os
from typing import Callable, Collection

import torch
import torch.distributed as dist

from eprt.kernels.cpu_workers import for_each
from eprt.models.moe import Experts
from eprt.models.taps import tapped
from eprt.parallel import ParallelState
from eprt.quant.calibrated import CalibrationRecord
from eprt.quant.formats import weight_format
from eprt.quant.formats.kv import kv_cache_format
from eprt.quant.loop.calibrate import CalibrationError, Calibrator
from eprt.quant.recipe import Recipe
from eprt.quant.scales import EXPERT_PIECES, Scales


@torch.inference_mode()
def greedy(model, hf_dir: str, prompt: str, new_tokens: int = 12) -> str:
    """The prompt's greedy continuation. Every rank runs it (the experts need all of them)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(os.path.join(hf_dir, "tokenizer.json"))
    ids = torch.tensor([tok.encode(prompt, add_special_tokens=False).ids])
    start = ids.shape[1]
    for _ in range(new_tokens):
        nxt = model(ids)[:, -1].float().argmax(-1, keepdim=True)
        ids = torch.cat([ids, nxt], dim=1)
    return tok.decode(ids[0, start:].tolist())


def expert_input_scales(
    scales: Scales, module: str, leaves: tuple[str, str], state: ParallelState
) -> dict[str, torch.Tensor | None]:
    """The input scales the engine quantizes routed experts `module`'s projections' inputs under
    (by leaf: what gate/up read, what down reads): each the layer's largest amax over every rank's
    experts (a collective: every rank calls it alike), the format's pinned scale, or None."""
    fmt = scales.format(module)
    out = dict.fromkeys(leaves, fmt.pinned_input_scale())
    for kind in leaves if fmt.uses_activation_statistics else ():
        layer_amax = scales.expert_input_amax(module, kind).clone()
        state.all_reduce(layer_amax, over="ep", op=dist.ReduceOp.MAX)
        out[kind] = scales.scale(module, layer_amax)
    return out


def fake_quantize(
    model,
    targets: list[str],
    recipe: Recipe,
    cal: Calibrator,
    state: ParallelState,
    *,
    prefix: str = "",
    source_dtype: Callable[[str], torch.dtype] | None = None,
    on_weight: Callable[[str, torch.Tensor], None] | None = None,
    quantized: Collection[str] = (),
) -> Callable[[], None]:
    """Replace every quantized module's weights and inputs by their quantize-dequantize, with the
    export's scales and numerics (eprt.quant.scales: each module's algorithm, max or mse): dense
    Linears' inputs, both projections' inputs of the routed experts, and with an FP8 KV cache the
    keys and values where calibration observed them.

    `model` holds the modules named `prefix` + their name in it (the whole model, or one decoder
    layer of a layer-by-layer run): only the targets it holds are quantized (the causal LM runs no
    multi-token-prediction layer), and the expert input scales are reduced over the ep group, so
    every rank must call it alike.
    `source_dtype(tensor name)` is the dtype the export rounds an FP8 quotient to (the source's;
    default the weight's own), so that the weights are the export's dequantized, bit for bit
    wherever the run's dtype holds the checkpoint's weights exactly. `quantized`: the modules whose
    weights already hold what the export writes (GPTQ's, eprt.quant.algorithms.gptq.layer), left as they are.
    `on_weight(tensor name, weight)` sees each weight as replaced (a routed-experts tensor: this
    rank's rows). Returns what removes the input and KV hooks (the weights stay replaced)."""
    sub = lambda m: model.get_submodule(m[len(prefix) :])  # noqa: E731
    present = {prefix + name for name, _ in model.named_modules()}
    targets = [m for m in targets if m.startswith(prefix) and m in present]
    formats = {m: recipe.format_of(m) for m in targets}

    def as_quantized(name: str, fmt: str, w: torch.Tensor) -> torch.Tensor:
        """w as the export quantizes it (eprt.quant.scales.as_quantized)."""
        return w.to(source_dtype(name)) if weight_format(fmt).rounds_in_weight_dtype and source_dtype is not None else w

    scales = Scales(
        formats,
        CalibrationRecord.of(cal),
        lambda m: as_quantized(f"{m}.weight", formats[m], sub(m).weight.detach()),
        {m: recipe.algorithm_of(m) for m in targets},
        recipe.scale_headroom,
    )

    def fake_weight(m: str, name: str, w: torch.Tensor, scale: torch.Tensor, pieces: int = 1) -> torch.Tensor:
        return scales.fake_quantize_weight(m, as_quantized(name, formats[m], w), scale, w.dtype, pieces)

    def weight_scale(what: str, compute: Callable[[], torch.Tensor]) -> torch.Tensor:
        try:
            return compute()
        except ValueError as e:  # a non-finite weight has no scale: name it, as export would fail on it
            raise CalibrationError(f"{what}: weight scale: {e}; check the checkpoint's weights for NaN/Inf") from None

    taps = contextlib.ExitStack()
    dense = [m for m in targets if not isinstance(sub(m), Experts)]
    # every scale first: a weight scale reads its fused siblings' weights, replaced below
    resolved = {
        m: (
            None if m in quantized else weight_scale(m, lambda m=m: scales.weight_scale(m)),
            scales.engine_input_scale(m),
        )
        for m in dense
    }
    with torch.no_grad():
        for m in dense:
            module, fmt = sub(m), formats[m]
            w_scale, in_scale = resolved[m]
            if m not in quantized:
                module.weight.copy_(fake_weight(m, f"{m}.weight", module.weight, w_scale))
            if on_weight is not None:
                on_weight(f"{m}.weight", module.weight)
            quant_input = (
                lambda _m, args, s=in_scale, f=weight_format(fmt).fake_quantize_input: (  # noqa: E731
                    f(args[0], s),
                    *args[1:],
                )
            )
            taps.callback(module.register_forward_pre_hook(quant_input).remove)
        for m in targets:
            experts = sub(m)
            if not isinstance(experts, Experts):
                continue
            fake = weight_format(formats[m]).fake_quantize_input
            for kind, w in experts.projections().items():  # per expert, gate and up under one scale
                name = f"{m}.{kind}"

                def expert(e: int, _, m=m, name=name, w=w, first=experts.first, pieces=EXPERT_PIECES[kind]) -> None:
                    row = as_quantized(name, formats[m], w[e])
                    scale = weight_scale(f"{name} (expert {first + e})", lambda: scales.expert_weight_scale(m, row))
                    w[e].copy_(fake_weight(m, name, w[e], scale, pieces))

                # each expert whole on one of eprt.kernels.cpu_workers' threads (one elsewhere)
                for_each(range(0 if m in quantized else w.shape[0]), lambda: None, expert, w.device)
                if on_weight is not None:
                    on_weight(name, w)
            leaf_in, leaf_out = experts.pieces.leaves
            in_scale = expert_input_scales(scales, m, experts.pieces.leaves, state)
            # down reads the activation: quantized where it is made
            taps.enter_context(
                tapped(
                    experts,
                    input=lambda x, s=in_scale[leaf_in], f=fake: f(x, s),
                    activation=lambda h, s=in_scale[leaf_out], f=fake: f(h, s),
                )
            )
    kv = kv_cache_format(recipe.kv_cache)
    if kv is not None:
        for name, attn in model.named_modules(prefix=prefix.rstrip(".")):
            if name in cal.kv_amax:
                k_scale, v_scale = (kv.scale(a) for a in cal.kv_amax[name])
                taps.enter_context(
                    tapped(
                        attn,
                        replace=lambda k, v, ks=k_scale, vs=v_scale: (kv.fake_quantize(k, ks), kv.fake_quantize(v, vs)),
                    )
                )
    return taps.close
