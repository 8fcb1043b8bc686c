"""A glance at the model before and after quantization: a short greedy continuation of a prompt.

After calibration the quantized modules are fake-quantized in place (weights quantized and
dequantized with the export's scales, inputs through their calibrated input scale), so
the continuation shows what the engine will compute. The model is not used afterwards:
export reads the weights from the checkpoint.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from eprt.models.moe import Experts
from eprt.quant.calibrate import Calibrator
from eprt.quant.calibrated import CalibrationState
from eprt.quant.fp8 import fake_quant_fp8
from eprt.quant.nvfp4 import fake_quant_nvfp4
from eprt.quant.recipe import Recipe
from eprt.quant.scales import EXPERT_KINDS, Scales

DEFAULT_PROMPT = "The river ran low in late summer, and"


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


def fake_quantize(model, targets: list[str], recipe: Recipe, cal: Calibrator, state) -> None:
    """Replace every quantized module's weights and inputs by their quantize-dequantize, with the
    export's scales (eprt.quant.scales): dense Linears' inputs, and both projections' inputs of
    the routed experts. The causal LM runs no multi-token-prediction layer: their targets are left out."""
    present = dict(model.named_modules())
    targets = [m for m in targets if m in present]
    scales = Scales({m: recipe.format_of(m) for m in targets}, CalibrationState.of(cal),
                    lambda m: model.get_submodule(m).weight.detach())
    fakes = {"fp8": fake_quant_fp8, "nvfp4": fake_quant_nvfp4}
    dense = [m for m in targets if not isinstance(model.get_submodule(m), Experts)]
    # every scale first: a weight scale reads its fused siblings' weights, replaced below
    resolved = {m: (scales.weight_scale(m), scales.input_scale(m)) for m in dense}
    with torch.no_grad():
        for m in dense:
            module, fake = model.get_submodule(m), fakes[scales.formats[m]]
            w_scale, in_scale = resolved[m]
            module.weight.copy_(fake(module.weight, w_scale))
            module.register_forward_pre_hook(lambda _m, args, s=in_scale, f=fake: (f(args[0], s), *args[1:]))
        for m in targets:
            experts = model.get_submodule(m)
            if not isinstance(experts, Experts):
                continue
            fake = fakes[scales.formats[m]]
            for w in (experts.w13, experts.w2):  # per expert, gate and up under one scale
                for e in range(w.shape[0]):
                    w[e].copy_(fake(w[e], scales.expert_weight_scale(m, w[e])))
            in_scale = {}
            for kind in EXPERT_KINDS:  # the layer's largest, over every rank's experts
                layer_amax = scales.expert_input_amax(m, kind).clone()
                state.all_reduce(layer_amax, over="ep", op=dist.ReduceOp.MAX)
                in_scale[kind] = scales.scale(m, layer_amax)
            experts.register_forward_pre_hook(lambda _m, args, s=in_scale["w13"], f=fake: (f(args[0], s), *args[1:]))
            # w2 reads act(gate, up): quantized where it is made
            experts.act = lambda gate, up, act=experts.act, s=in_scale["w2"], f=fake: f(act(gate, up), s)
