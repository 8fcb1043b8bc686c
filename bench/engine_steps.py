"""Where a row of the engine check parts from vLLM, step by step (docs/engine-check.md, "Routing ties").

    .venv-engine/bin/python bench/engine_steps.py --family glm4_moe --export unquantized [--work DIR]

Builds the row's export as bench/engine_check.py does, runs it in vLLM (bench/engine_runner.py) and
the reference teacher-forced on vLLM's tokens, and prints for each prompt and step (the prefill, then
each decode step): the logprob difference of vLLM's token and each decoder layer's relative
difference on that step's last token; where the logprobs differ by more than LOGPROB_TOL, each
router's four largest logits on both sides (vLLM's as it computed them, the reference's in fp32 from
its router's own input), which shows an expert chosen apart.
"""

from __future__ import annotations

import argparse
import os

import torch
from engine_check import (
    build_exports,
    engine_semantics,
    mla_decode_forwards,
    quantize_inputs,
    reference_model,
    run_engine,
)
from engine_compare import LOGPROB_TOL, decoder_layers, replaced_forwards, submodule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def router_logits(router: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A router's logits of its input's last token in fp32 (its weight, and its bias if it has one)."""
    bias = getattr(router, "bias", None)
    last = x.reshape(-1, x.shape[-1])[-1].float()
    return torch.nn.functional.linear(last, router.weight.float(), None if bias is None else bias.float())


def reference_steps(model, prompt: dict, decode: dict, routers: list[str]) -> tuple[torch.Tensor, list, list]:
    """The reference teacher-forced on one prompt's engine tokens: its log-probabilities per step, and
    per step the last token's output of each decoder layer and each router's logits by name."""
    layers: list[list[torch.Tensor]] = []
    routed: list[dict[str, torch.Tensor]] = []

    def record_layer(_m, _i, out):
        layers[-1].append((out[0] if isinstance(out, tuple) else out)[0, -1].float())

    def record_router(name):
        return lambda m, args, _o: routed[-1].__setitem__(name, router_logits(m, args[0]))

    hooks = [layer.register_forward_hook(record_layer) for layer in decoder_layers(model)]
    hooks += [submodule(model, name).register_forward_hook(record_router(name)) for name in routers]

    def step(ids: list[int], cache=None):
        layers.append([])
        routed.append({})
        return model(torch.tensor([ids]), past_key_values=cache, use_cache=True)

    with torch.no_grad():
        out = step(prompt["prompt"])
        logits = [out.logits[0, -1]]
        with replaced_forwards(decode):
            for token in prompt["tokens"][:-1]:
                out = step([token], out.past_key_values)
                logits.append(out.logits[0, -1])
    for h in hooks:
        h.remove()
    return torch.log_softmax(torch.stack(logits).float(), dim=-1), layers, routed


def top(logits: torch.Tensor) -> str:
    return " ".join(f"{e}:{logits[e]:.4f}" for e in logits.argsort(descending=True)[:4].tolist())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", required=True)
    ap.add_argument("--export", default="unquantized")
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "engine-steps"))
    a = ap.parse_args()
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    export = build_exports(a.family, a.work, [a.export])[a.export]
    if not isinstance(export, str):
        raise SystemExit(f"{a.family} {a.export}: {export}")
    engine = run_engine(export, os.path.join(a.work, a.family, f"engine-{a.export}.json"))
    if "error" in engine:
        raise SystemExit(f"{a.family} {a.export}: vLLM: {engine['error']}")
    model, modules = reference_model(export, os.path.join(a.work, a.family))
    semantics = engine_semantics(engine["kernels"])
    quantize_inputs(model, modules, semantics)
    decode = mla_decode_forwards(model, modules, semantics)
    for i, p in enumerate(engine["prompts"]):
        names = list(dict.fromkeys(r["router"] for r in p["routers"]))
        engine_routers = [p["routers"][s : s + len(names)] for s in range(0, len(p["routers"]), len(names) or 1)]
        logprobs, layers, routed = reference_steps(model, p, decode, names)
        for step, token in enumerate(p["tokens"]):
            diff = abs(logprobs[step, token].item() - p["logprobs"][step])
            rel = [
                ((torch.tensor(e) - r).abs().mean() / r.abs().mean()).item()
                for e, r in zip(p["steps"][step], layers[step])
            ]
            print(
                f"prompt {i} step {step} token {token}: logprob {diff:.4f}, layers " + " ".join(f"{d:.4f}" for d in rel)
            )
            if diff > LOGPROB_TOL:
                for seen in engine_routers[step]:
                    print(
                        f"  {seen['router']}: vLLM {top(torch.tensor(seen['logits']))} | reference {top(routed[step][seen['router']])}"
                    )


if __name__ == "__main__":
    main()
