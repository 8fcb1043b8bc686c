"""A glance at the model before and after quantization: a short greedy continuation of a prompt.

After calibration the quantized modules are fake-quantized in place (weights quantized and
dequantized with the export's scales, dense inputs through their calibrated input scale), so
the continuation shows what the engine will compute. The model is not used afterwards:
export reads the weights from the checkpoint.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from eprt.models.moe import Experts
from eprt.quant.calibrate import Calibrator
from eprt.quant.fp8 import fake_quant_fp8, fp8_scale
from eprt.quant.fusion import siblings
from eprt.quant.nvfp4 import fake_quant_nvfp4, nvfp4_scale

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


def fake_quantize(model, targets: list[str], fmt: str, cal: Calibrator, state) -> None:
    """Replace every quantized module's weights and dense inputs by their quantize-dequantize."""
    fake, scale = (fake_quant_fp8, fp8_scale) if fmt == "fp8" else (fake_quant_nvfp4, nvfp4_scale)
    quantized = set(targets)
    dense = [m for m in targets if not isinstance(model.get_submodule(m), Experts)]
    w_amax = {m: model.get_submodule(m).weight.detach().abs().amax().float() for m in dense}
    with torch.no_grad():
        for m in dense:
            group = siblings(m, quantized, fmt)
            module = model.get_submodule(m)
            module.weight.copy_(fake(module.weight, scale(max(w_amax[s] for s in group))))
            in_scale = scale(max(cal.input_amax[s] for s in group))
            module.register_forward_pre_hook(lambda _m, args, s=in_scale: (fake(args[0], s), *args[1:]))
        for m in targets:
            experts = model.get_submodule(m)
            if not isinstance(experts, Experts):
                continue
            for w in (experts.w13, experts.w2):  # per expert, gate and up under one scale
                for e in range(w.shape[0]):
                    w[e].copy_(fake(w[e], scale(w[e].abs().amax().float())))
            layer_amax = cal.expert_amax[m][0].max().clone()  # the layer's largest, as the export writes it
            state.all_reduce(layer_amax, over="ep", op=dist.ReduceOp.MAX)
            in_scale = scale(layer_amax)
            experts.register_forward_pre_hook(lambda _m, args, s=in_scale: (fake(args[0], s), *args[1:]))
