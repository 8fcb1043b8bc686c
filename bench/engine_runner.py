"""Load one export in vLLM's CPU build and write its greedy tokens, logprobs and layer outputs as JSON.

    python bench/engine_runner.py EXPORT --prompts '[[5, 17, ...], ...]' --max-tokens 8 --out RESULT.json

Started by bench/engine_check.py as a child process, so the shims below change vLLM in this process
only. vLLM 0.32's CPU build runs none of the quantized exports as it ships; each shim is the
smallest change that lets it run one format, with vLLM's own numerics wherever vLLM has them
(docs/engine-check.md lists them and what they still cannot run).
"""

from __future__ import annotations

import argparse
import json
import os

# Before vLLM is imported: the engine runs in this process (so the shims and the layer hooks reach
# it), with a small KV cache and a memory share that a shared 24 GiB machine grants.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

import engine_shims
import torch
from engine_shims import SHIMS


def decoder_layers(llm) -> list[torch.nn.Module]:
    """The model's decoder layers, reached in this process (V1 engine without multiprocessing); a
    vision-language model's are its language model's."""
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    return list(getattr(model, "language_model", model).model.layers)


def kernels(llm) -> dict[str, str]:
    """The kernel vLLM chose for each quantized module (Linear kernel or routed-experts class), by
    module name: what says whether it ran weight-only or quantized the activations too."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    chosen = {}
    for name, module in runner.get_model().named_modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__.startswith("Unquantized"):  # a bf16 module
            continue
        scheme = getattr(module, "scheme", None)  # compressed-tensors keeps the kernel on the layer's scheme
        kernel = (
            getattr(method, "kernel", None)
            or getattr(scheme, "kernel", None)
            or getattr(scheme, "fp8_linear", None)  # compressed-tensors' W8A8 FP8 scheme names it so
            or getattr(method, "experts_cls", None)
        )
        if kernel is not None:
            chosen[name] = kernel.__name__ if isinstance(kernel, type) else type(kernel).__name__
    return chosen


def quantized_linear_hooks(llm, linears: dict[str, dict]) -> list:
    """Hooks recording each quantized Linear's first call (the prefill): its input and its output, by
    module name (vLLM's, fused siblings as one: qkv_proj, gate_up_proj, fused_qkv_a_proj)."""
    from vllm.model_executor.layers.linear import LinearBase

    def record(name):
        def hook(_m, args, out):
            y = out[0] if isinstance(out, tuple) else out  # vLLM's Linears return (output, bias)
            linears.setdefault(name, {"input": args[0].float().tolist(), "output": y.float().tolist()})

        return hook

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    quantized = kernels(llm)
    return [
        module.register_forward_hook(record(name))
        for name, module in runner.get_model().named_modules()
        if isinstance(module, LinearBase) and name in quantized
    ]


def moe_block_hooks(llm, blocks: dict[str, dict]) -> list:
    """Hooks recording the first call (the prefill) of each MoE block whose routed experts are
    quantized: its input and its output (router, routed and shared experts together), by module name
    (the module holding `experts`, whose quantized kernel vLLM names `...experts.routed_experts`; the
    block has the same name in transformers)."""

    def record(name):
        def hook(_m, args, kwargs, out):
            x = args[0] if args else kwargs["hidden_states"]
            blocks.setdefault(name, {"input": x.float().tolist(), "output": out.float().tolist()})

        return hook

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    blocks_of_experts = {name.partition(".experts")[0] for name in kernels(llm) if ".experts" in name}
    return [
        module.register_forward_hook(record(name), with_kwargs=True)
        for name, module in runner.get_model().named_modules()
        if name in blocks_of_experts
    ]


def router_hooks(llm, routers: list[dict]) -> list:
    """Hooks recording each router's logits (vLLM's GateLinear modules, by name) on the last token of
    every forward, one dict per router call in `routers`: with the decoder layers' outputs, what
    bench/engine_steps.py puts beside the reference's at every decode step."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    def record(name):
        def hook(_m, _args, out):
            logits = out[0] if isinstance(out, tuple) else out
            routers.append({"router": name, "logits": logits[-1].float().tolist()})

        return hook

    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    return [
        module.register_forward_hook(record(name))
        for name, module in runner.get_model().named_modules()
        if isinstance(module, GateLinear)
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("export")
    ap.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--no-shims", action="store_true", help="vLLM as it ships")
    a = ap.parse_args()
    if not a.no_shims:
        for shim in SHIMS:
            shim()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    with open(os.path.join(a.export, "config.json")) as f:
        config = json.load(f)
    llm = LLM(
        model=a.export,
        dtype="bfloat16",
        enforce_eager=True,
        # a vision-language model's multimodal processor is built from the tokenizer (the tiny
        # checkpoints carry one); the prompts are token ids either way
        skip_tokenizer_init="vision_config" not in config,
        max_model_len=256,
        max_num_seqs=1,
        gpu_memory_utilization=0.2,
        enable_prefix_caching=False,
        seed=0,
        # vLLM checks that every parameter came from the checkpoint only for unquantized models; a
        # quantized export whose tensors its loader does not reach (GPT-OSS's per-expert experts)
        # would run on uninitialized weights: held to that check too
        model_loader_extra_config={"enable_weights_track": True},
    )
    prompts = json.loads(a.prompts)
    results = []
    linears: dict[str, dict] = {}
    moe_blocks: dict[str, dict] = {}
    for i, ids in enumerate(prompts):  # one prompt at a time, so each layer output is that prompt's prefill
        captured: list[torch.Tensor] = []
        routers: list[dict] = []
        hooks = [
            layer.register_forward_hook(lambda _m, _i, out, captured=captured: captured.append(_layer_output(out)))
            for layer in decoder_layers(llm)
        ] + router_hooks(llm, routers)
        if i == 0:
            hooks += quantized_linear_hooks(llm, linears) + moe_block_hooks(llm, moe_blocks)
            engine_shims.RECORDED = []
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0.0, max_tokens=a.max_tokens, logprobs=0)
        )[0].outputs[0]
        if i == 0:  # the prefill's calls come first, a block at a time in the order the blocks ran
            experts = dict(zip(moe_blocks, engine_shims.RECORDED))
            engine_shims.RECORDED = None
        for h in hooks:
            h.remove()
        n = len(decoder_layers(llm))
        prefill = captured[:n]  # the first forward is the prompt's prefill
        results.append(
            {
                "prompt": ids,
                "tokens": list(out.token_ids),
                "logprobs": [step[t].logprob for step, t in zip(out.logprobs, out.token_ids)],
                "layers": [t.float().tolist() for t in prefill],
                # every forward's (the prefill's, then each decode step's) last token: each layer's output
                "steps": [[t[-1].tolist() for t in captured[s : s + n]] for s in range(0, len(captured), n)],
                "routers": routers,
            }
        )
    with open(a.out, "w") as f:
        json.dump(
            {
                "kernels": kernels(llm),
                "prompts": results,
                "linears": linears,
                "moe_blocks": moe_blocks,
                "experts": experts,
            },
            f,
        )


def _layer_output(out) -> torch.Tensor:
    """vLLM's decoder layers return (hidden_states, residual), the layer's output being their sum."""
    if isinstance(out, tuple):
        hidden, residual = out[0], out[1]
        return (hidden.float() + residual.float()) if residual is not None else hidden.float()
    return out.float()


if __name__ == "__main__":
    main()
