"""The engine check's comparisons (bench/engine_check.py): the reference against vLLM, module by
module on vLLM's own inputs (quantized Linears, routed experts GEMM by GEMM, MoE blocks) and end to
end teacher-forced on vLLM's tokens (logprobs, greedy tokens, layer outputs), with the tolerances
and the reference's own noise floor they are held to (docs/engine-check.md, "Tolerances")."""

from __future__ import annotations

import contextlib
import functools
import re

import torch
from engine_reference import FUSED, InputQuant, Module, engine_linear, jittered_inputs, nvfp4_input, silu_and_mul

WEIGHT_ONLY = "weight-only"  # a kernel's semantics where it leaves the input in bf16

# Tolerances (docs/engine-check.md, "Tolerances"): bf16 keeps 8 significant bits, so one rounding of
# a value moves it by up to 2^-9 of it; the engine and the reference round in different places.
LOGPROB_TOL = 0.02  # nats
LAYER_TOL = 2**-6  # mean |engine - reference| / mean |reference| of the first decoder layer's output
TIE_MARGIN = 0.02  # a greedy mismatch where the reference's top two are closer than this is a tie
# A kernel that rounds its input to a grid of relative spacing D turns the bf16 differences (2^-9) of an
# input the engine and the reference compute apart into crossings of a rounding boundary: probability
# ~2^-9 / D, each a step D, an rms change sqrt(2^-9 D). That is 2^-6 for E4M3 (D = 2^-3: W8A8, within
# LAYER_TOL), 2^-5 for E2M1 (D = 2^-1): the rows with a W4A4 kernel get twice the layer and logprob
# tolerances, and their semantics are held by LINEAR_TOL instead.
W4A4_FACTOR = 2
# Each quantized Linear on vLLM's own input: the same products on both sides, summed in another order
# and rounded once to bf16 (each within 2^-9 of the sum). It holds the W4A4 Linears, whose reference is
# vLLM's arithmetic bit for bit; the others' largest is reported (docs/engine-check.md).
LINEAR_TOL = 2**-8
# Draws of the reference's noise floor (`noise_floor`): the least of them is the floor, so one draw
# that happens to move a near tie does not widen the tolerance.
FLOOR_SEEDS = 3


def ran(semantics: dict[tuple[str, str], str], fmt: str, kind: str, module: str) -> str:
    """The semantics vLLM ran `module` (a quantized `fmt` module of `kind`) under; refused where vLLM
    reported no kernel for it, rather than guessed."""
    if (fmt, kind) not in semantics:
        raise ValueError(
            f"vLLM reported no kernel for {fmt} {kind} modules ({module}): see kernels() in engine_runner.py"
        )
    return semantics[(fmt, kind)]


def layer_input(projections: dict[str, Module], *kinds: str) -> InputQuant:
    """The one input quantization the engines load per projection kind of a layer's experts: a static
    scale is the largest of the experts' (every expert's is that already, docs/export.md). vLLM's
    NVFP4 MoE quantizes under fp32 1 / that input scale in either layout (compressed-tensors' stored
    input_global_scale inverted twice), which a Linear need not."""
    qs = [m.inputs for p, m in projections.items() if p.rpartition(".")[2] in kinds]
    q = max(qs, key=lambda q: q.scale)
    return nvfp4_input(q.scale) if q.kind == "nvfp4" else q


def submodule(model, name: str) -> torch.nn.Module:
    """The reference's module of checkpoint name `name`: as transformers renames the checkpoint's
    modules on load (its WeightRenamings of the model type: MiniMax-M2's `block_sparse_moe` is its
    `mlp`); a vision-language model's language model is `language_model.model.*` in the checkpoint
    and in vLLM, `model.language_model.*` in the transformers classes that hold it under their base
    model (Mistral-3, MiniMax-M3), and `model.*` where the reference is the language model alone
    (Kimi-VL, `engine_check.reference_model`)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    rest = name.removeprefix("language_model.model.")
    names = [name] if rest == name else [name, f"model.language_model.{rest}", f"model.{rest}"]
    renamings = [
        (source, target)
        for r in get_checkpoint_conversion_mapping(model.config.model_type) or []
        if type(r).__name__ == "WeightRenaming"
        for source, target in zip(r.source_patterns, r.target_patterns)
    ]
    # the renamings match a tensor's name, so a module's is matched with a "." after it
    renamed = [functools.reduce(lambda n, st: re.sub(*st, n), renamings, f"{n}.")[:-1] for n in names]
    for candidate in names + renamed:
        with contextlib.suppress(AttributeError):
            return model.get_submodule(candidate)
    raise ValueError(f"{type(model).__name__} holds no module {name}")


def decoder_layers(model) -> torch.nn.ModuleList:
    """The reference's decoder layers: its language model's, in a vision-language model."""
    for name in ("model.layers", "language_model.model.layers", "model.language_model.layers"):
        with contextlib.suppress(AttributeError):
            return model.get_submodule(name)
    raise ValueError(f"{type(model).__name__}: no decoder layers found")


# A routed expert's projections by the names the export gives them: MiniMax's w1 (gate), w3 (up), w2
# (down) beside the gate_proj / up_proj / down_proj of the others.
EXPERT_PROJECTIONS = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def routed_projections(modules: dict[str, Module], experts: str) -> dict[str, Module]:
    """The quantized projections of the routed experts module `experts` ("...experts"), by "E.gate_proj",
    "E.up_proj" and "E.down_proj"."""
    out = {}
    for name, m in modules.items():
        if name.startswith(f"{experts}.") and name[len(experts) + 1 :].split(".")[0].isdigit():
            e, _, projection = name[len(experts) + 1 :].partition(".")
            out[f"{e}.{EXPERT_PROJECTIONS.get(projection, projection)}"] = m
    return out


# vLLM's names for the fused Linears (engine_reference.FUSED: the checkpoint's Linears each holds, in
# output order)
ENGINE_FUSED = dict(zip(("qkv_proj", "gate_up_proj", "fused_qkv_a_proj"), FUSED))


def compare_linears(modules: dict[str, Module], semantics: dict[tuple[str, str], str], linears: dict) -> dict:
    """Each quantized Linear vLLM ran on the first prompt, teacher-forced: the reference's module (its
    input quantized as the kernel's semantics say, its dequantized bf16 weight, a bf16 matmul) on
    vLLM's own input, against vLLM's output. {vLLM's module: (mean |vLLM - reference| / mean
    |reference|, the semantics it ran under)}"""
    diffs = {}
    for name, seen in linears.items():
        prefix, _, leaf = name.rpartition(".")
        members = [f"{prefix}.{m}" for m in ENGINE_FUSED.get(leaf, (leaf,))]
        x = torch.tensor(seen["input"], dtype=torch.bfloat16)
        outs = []
        for member in members:
            if member not in modules:
                raise ValueError(f"vLLM ran {name} quantized, but the export holds no quantized {member}")
            m = modules[member]
            quantized = m.inputs and ran(semantics, m.fmt, "linear", member) != WEIGHT_ONLY
            outs.append(engine_linear(x, m.weight, m.inputs if quantized else None, bias=m.bias).float())
        ref = torch.cat(outs, dim=-1)
        diff = ((torch.tensor(seen["output"]) - ref).abs().mean() / ref.abs().mean()).item()
        diffs[name] = (diff, ran(semantics, m.fmt, "linear", member))
    return diffs


def compare_moe_blocks(model, blocks: dict) -> dict:
    """Each MoE block whose routed experts vLLM ran quantized, teacher-forced on the first prompt: the
    reference's block (its router, its experts as `experts_forward` runs them, its shared experts) on
    vLLM's own input, against vLLM's output. {block: mean |vLLM - reference| / mean |reference|}"""
    diffs = {}
    for name, seen in blocks.items():
        x = torch.tensor(seen["input"], dtype=torch.bfloat16)
        with torch.no_grad():
            out = submodule(model, name)(x[None])
        ref = (out[0] if isinstance(out, tuple) else out)[0].float()
        diffs[name] = ((torch.tensor(seen["output"]) - ref).abs().mean() / ref.abs().mean()).item()
    return diffs


def compare_experts(modules: dict[str, Module], semantics: dict[tuple[str, str], str], engine: dict) -> dict:
    """Each routed expert vLLM ran on the first prompt's prefill, teacher-forced GEMM by GEMM as
    `compare_linears` does the Linears: the reference's gate/up (its input quantized as the kernel's
    semantics say) on the block's own input rows, against vLLM's; its down projection on vLLM's
    activation, against vLLM's fp32 sum. {block: (largest mean |vLLM - reference| / mean |reference|
    over its experts' GEMMs, the share of activation elements the reference's `silu_and_mul` puts
    apart from vLLM's, the semantics)}."""
    out = {}
    for block, calls in engine["experts"].items():
        projections = routed_projections(modules, f"{block}.experts")
        sem = ran(semantics, next(iter(projections.values())).fmt, "experts", block)
        quantized = sem != WEIGHT_ONLY
        in_13 = layer_input(projections, "gate_proj", "up_proj") if quantized else None
        in_2 = layer_input(projections, "down_proj") if quantized else None
        x = torch.tensor(engine["moe_blocks"][block]["input"], dtype=torch.bfloat16)
        worst, moved, elements = 0.0, 0, 0
        for e, seen in calls.items():
            gate_up = torch.cat([projections[f"{e}.gate_proj"].weight, projections[f"{e}.up_proj"].weight])
            h = engine_linear(x[seen["tokens"]], gate_up, in_13, fp8_by_reciprocal=False).float()
            act = torch.tensor(seen["act"], dtype=torch.bfloat16)
            y = engine_linear(act, projections[f"{e}.down_proj"].weight, in_2, False, torch.float32)
            for ref, eng in ((h, seen["gate_up"]), (y, seen["down"])):
                worst = max(worst, ((torch.tensor(eng) - ref).abs().mean() / ref.abs().mean()).item())
            gate, up = torch.tensor(seen["gate_up"]).chunk(2, dim=-1)
            moved += int((silu_and_mul(gate, up) != act).sum())
            elements += act.numel()
        out[block] = (worst, moved / max(elements, 1), sem)
    return out


@contextlib.contextmanager
def replaced_forwards(forwards: dict):
    """Each module of `forwards` runs the forward given there, until the block ends."""
    before = {module: module.forward for module in forwards}
    for module, forward in forwards.items():
        module.forward = forward
    try:
        yield
    finally:
        for module, forward in before.items():
            module.forward = forward


def teacher_forced(model, prompts: list[dict], decode_forwards: dict) -> list[tuple[torch.Tensor, list]]:
    """The reference teacher-forced on the engine's tokens, step by step as the engine runs them (each
    prompt's prefill, then each token a decode step on the cache, `decode_forwards` in place): per
    prompt, the log-probabilities of every step and each decoder layer's output on the prompt."""
    runs = []
    for p in prompts:
        captured: list[torch.Tensor] = []
        hooks = [
            layer.register_forward_hook(
                lambda _m, _i, out, captured=captured: captured.append(
                    (out[0] if isinstance(out, tuple) else out)[0].float()
                )
            )
            for layer in decoder_layers(model)
        ]
        with torch.no_grad():
            out = model(torch.tensor([p["prompt"]]), use_cache=True)
        for h in hooks:
            h.remove()
        logits = [out.logits[0, -1]]
        with torch.no_grad(), replaced_forwards(decode_forwards):
            for token in p["tokens"][:-1]:
                out = model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
                logits.append(out.logits[0, -1])
        runs.append((torch.log_softmax(torch.stack(logits).float(), dim=-1), captured))
    return runs


def noise_floor(model, prompts: list[dict], decode_forwards: dict, seeds: int = FLOOR_SEEDS) -> float:
    """How far the reference's own logprobs of the engine's tokens move when every input it quantizes
    moves by one bf16 step on a random half of its elements (engine_reference.jittered_inputs): the
    least over `seeds` draws of the largest move. 0 where nothing quantizes its input."""

    def chosen(runs):
        return torch.cat([lp[torch.arange(len(p["tokens"])), p["tokens"]] for (lp, _), p in zip(runs, prompts)])

    base = chosen(teacher_forced(model, prompts, decode_forwards))
    moves = []
    for seed in range(seeds):
        with jittered_inputs(seed):
            moves.append((chosen(teacher_forced(model, prompts, decode_forwards)) - base).abs().max().item())
    return min(moves)


def compare(model, engine: dict, decode_forwards: dict, factor: float = 1, floor: float = 0.0) -> dict:
    """Teacher-forced on the engine's tokens (`teacher_forced`): greedy agreement, logprob and
    layer-output differences. The tolerances: `factor` times LAYER_TOL for the first layer; the larger
    of `factor` times LOGPROB_TOL and the reference's own noise `floor` for the logprobs, and of
    TIE_MARGIN and `floor` for a greedy mismatch to count as a tie."""
    worst_logprob, worst_first, worst_layer, mismatches, ties = 0.0, 0.0, 0.0, 0, 0
    tie = max(TIE_MARGIN, floor)
    for p, (logprobs, captured) in zip(engine["prompts"], teacher_forced(model, engine["prompts"], decode_forwards)):
        for step, (token, lp) in enumerate(zip(p["tokens"], p["logprobs"])):
            worst_logprob = max(worst_logprob, abs(logprobs[step, token].item() - lp))
            top = logprobs[step].argmax().item()
            if top != token:
                if logprobs[step, top] - logprobs[step, token] < tie:
                    ties += 1
                else:
                    mismatches += 1
        n = len(p["prompt"])
        diffs = [
            ((torch.tensor(eng) - ref[:n]).abs().mean() / ref[:n].abs().mean()).item()
            for ref, eng in zip(captured, p["layers"])
        ]
        worst_first, worst_layer = max(worst_first, diffs[0]), max(worst_layer, *diffs)
    # Only the first layer is held to LAYER_TOL: it sees the same embeddings in both, so its difference
    # is that layer's arithmetic alone; later layers add up the differences of every layer before them.
    logprob_tol = max(factor * LOGPROB_TOL, floor)
    ok = mismatches == 0 and worst_logprob <= logprob_tol and worst_first <= factor * LAYER_TOL
    return {
        "result": "pass" if ok else "FAIL",
        "token_mismatches": mismatches,
        "ties": ties,
        "max_logprob_diff": worst_logprob,
        "logprob_tol": logprob_tol,
        "first_layer_rel_diff": worst_first,
        "max_layer_rel_diff": worst_layer,
    }
