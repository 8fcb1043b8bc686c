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

import torch

NVFP4_BLOCK = 16
FP8_MAX = 448.0


def register_nvfp4_linear_emulation() -> None:
    """NVFP4 Linears: vLLM lists its EmulationNvFp4LinearKernel (dequantize the weight, fake-quantize
    the activation to NVFP4 with the input scale, bf16 matmul) for CUDA and ROCm only; on CPU the
    kernel choice finds nothing and the load fails. Register vLLM's own kernel for the CPU platform."""
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")


def experts_in_torch(
    experts,
    output: torch.Tensor,
    x_TD: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation,
    gate_up,
    down,
) -> None:
    """A routed-experts forward as vLLM's Triton MoE computes it, in torch matmuls: each expert's
    gate/up GEMM over its tokens (fp32 accumulation, rounded to the model dtype), vLLM's own activation,
    the down GEMM, the router weight applied in fp32 and rounded, then the top-k outputs summed.
    gate_up(e, x) and down(e, h) are one expert's GEMMs, its format's numerics inside."""
    dtype = output.dtype
    out_TKD = torch.zeros(*topk_ids.shape, output.size(-1), dtype=torch.float32)
    for e in topk_ids.unique().tolist():
        rows_t, rows_k = (topk_ids == e).nonzero(as_tuple=True)
        h = gate_up(e, x_TD[rows_t]).to(dtype)
        act = torch.empty(h.size(0), experts.adjust_N_for_activation(h.size(1), activation), dtype=dtype)
        experts.activation(activation, act, h)
        y = down(e, act) * topk_weights[rows_t, rows_k].float()[:, None]
        out_TKD[rows_t, rows_k] = y.to(dtype).float()
    output.copy_(out_TKD.sum(dim=1).to(dtype))


def run_nvfp4_emulation_experts_in_torch() -> None:
    """NVFP4 routed experts: vLLM's emulation experts (Nvfp4QuantizationEmulationTritonExperts) keep
    their numerics in torch (activation NVFP4 quantize-dequantize, weight dequantization) but run the
    two GEMMs, the token alignment and the top-k sum as Triton/CUDA kernels, and declare themselves for
    CUDA and XPU only. Keep vLLM's quantize-dequantize, dequantization and activation; run the GEMMs
    as torch matmuls (experts_in_torch)."""
    from vllm.model_executor.layers.fused_moe.experts import nvfp4_emulation_moe as emulation
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input
    from vllm.model_executor.layers.quantization.utils.nvfp4_emulation_utils import dequantize_to_dtype

    def qdq(x: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
        return moe_kernel_quantize_input(
            A=x, A_scale=global_scale, quant_dtype="nvfp4", per_act_token_quant=False, quantization_emulation=True
        )[0]

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        assert expert_map is None and not apply_router_weight_on_input, "one rank, router weights after w2"
        qc, dtype = self.quant_config, hidden_states.dtype

        def weight(w, scale, global_scale):
            return dequantize_to_dtype(w, scale, global_scale, dtype, NVFP4_BLOCK, swizzle=False).float()

        experts_in_torch(
            self,
            output,
            qdq(hidden_states, qc.a1_gscale),
            topk_weights,
            topk_ids,
            activation,
            lambda e, x: x.float() @ weight(w1[e], self.w1_scale_val[e], qc.g1_alphas[e]).t(),
            lambda e, h: qdq(h, qc.a2_gscale).float() @ weight(w2[e], self.w2_scale_val[e], qc.g2_alphas[e]).t(),
        )

    emulation.Nvfp4QuantizationEmulationTritonExperts.apply = apply
    emulation.Nvfp4QuantizationEmulationTritonExperts._supports_current_device = staticmethod(lambda: True)


def run_fp8_tensor_experts_in_torch() -> None:
    """Per-tensor FP8 routed experts: vLLM's CPU MoE backends take block-FP8 experts only, and the
    Triton experts that take per-tensor scales (W8A8: the input quantized by the static input_scale,
    as on a GPU) declare themselves for CUDA and XPU only. Let the Triton experts load on CPU and run
    their forward as torch matmuls (experts_in_torch) on the dequantized FP8 values: the input as vLLM
    quantized it before the call, the down input by vLLM's own moe_kernel_quantize_input."""
    from vllm.model_executor.layers.fused_moe.experts import triton_moe
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input
    from vllm.model_executor.layers.quantization.utils.quant_utils import kFp8StaticTensorSym

    def apply(
        self,
        output,
        hidden_states,
        w1,
        w2,
        topk_weights,
        topk_ids,
        activation,
        global_num_experts,
        expert_map,
        a1q_scale,
        a2_scale,
        workspace13,
        workspace2,
        expert_tokens_meta,
        apply_router_weight_on_input,
    ):
        qc = self.quant_config
        assert expert_map is None and not apply_router_weight_on_input, "one rank, router weights after w2"
        assert qc.use_fp8_w8a8 and qc.block_shape is None and not qc.per_act_token_quant, "per-tensor FP8 only"
        x = hidden_states.float() * a1q_scale.float() if a1q_scale is not None else hidden_states.float()

        def down(e, h):
            h_q, h_scale = moe_kernel_quantize_input(
                A=h, A_scale=a2_scale, quant_dtype=qc.quant_dtype, per_act_token_quant=False
            )
            return (h_q.float() * h_scale.float()) @ (w2[e].float() * qc.w2_scale[e].float()).t()

        experts_in_torch(
            self,
            output,
            x,
            topk_weights,
            topk_ids,
            activation,
            lambda e, xe: xe @ (w1[e].float() * qc.w1_scale[e].float()).t(),
            down,
        )

    triton_moe.TritonExperts.apply = apply
    triton_moe.TritonExperts._supports_current_device = staticmethod(lambda: True)
    # vLLM's CPU platform says it has no FP8 (supports_fp8), which the Triton experts read as "no FP8
    # scheme": accept the one scheme the forward above runs, static per-tensor weights and inputs.
    triton_moe.TritonExperts._supports_quant_scheme = staticmethod(
        lambda weight_key, activation_key: (weight_key, activation_key) == (kFp8StaticTensorSym, kFp8StaticTensorSym)
    )


def static_fp8_quant_in_torch() -> None:
    """FP8 with a static per-tensor scale: vLLM's scaled_fp8_quant calls the compiled
    static_scaled_fp8_quant, which the CPU build declares without arguments, and the FP8 loader needs
    it to requantize a fused module (q/k/v, an expert's gate/up) to its largest member scale. Run that
    case in torch (x / scale, saturated to +-448, rounded to E4M3 once), every other case as before."""
    from vllm import _custom_ops as ops

    compiled = ops.scaled_fp8_quant

    def scaled_fp8_quant(input, scale=None, *args, output=None, group_shape=None, **kwargs):
        if scale is None or scale.numel() != 1 or args or any(v for v in kwargs.values()):
            return compiled(input, scale, *args, output=output, group_shape=group_shape, **kwargs)
        q = (input.float() / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if output is None:
            return q, scale
        output.copy_(q)
        return output, scale

    ops.scaled_fp8_quant = scaled_fp8_quant


SHIMS = [
    register_nvfp4_linear_emulation,
    run_nvfp4_emulation_experts_in_torch,
    static_fp8_quant_in_torch,
    run_fp8_tensor_experts_in_torch,
]


def decoder_layers(llm) -> list[torch.nn.Module]:
    """The model's decoder layers, reached in this process (V1 engine without multiprocessing)."""
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    return list(runner.get_model().model.layers)


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
            getattr(method, "kernel", None) or getattr(scheme, "kernel", None) or getattr(method, "experts_cls", None)
        )
        if kernel is not None:
            chosen[name] = kernel.__name__ if isinstance(kernel, type) else type(kernel).__name__
    return chosen


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

    llm = LLM(
        model=a.export,
        dtype="bfloat16",
        enforce_eager=True,
        skip_tokenizer_init=True,
        max_model_len=256,
        max_num_seqs=1,
        gpu_memory_utilization=0.2,
        enable_prefix_caching=False,
        seed=0,
    )
    prompts = json.loads(a.prompts)
    results = []
    for ids in prompts:  # one prompt at a time, so each layer output is that prompt's prefill
        captured: list[torch.Tensor] = []
        hooks = [
            layer.register_forward_hook(lambda _m, _i, out, captured=captured: captured.append(_layer_output(out)))
            for layer in decoder_layers(llm)
        ]
        out = llm.generate(
            [TokensPrompt(prompt_token_ids=ids)], SamplingParams(temperature=0.0, max_tokens=a.max_tokens, logprobs=0)
        )[0].outputs[0]
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
            }
        )
    with open(a.out, "w") as f:
        json.dump({"kernels": kernels(llm), "prompts": results}, f)


def _layer_output(out) -> torch.Tensor:
    """vLLM's decoder layers return (hidden_states, residual), the layer's output being their sum."""
    if isinstance(out, tuple):
        hidden, residual = out[0], out[1]
        return (hidden.float() + residual.float()) if residual is not None else hidden.float()
    return out.float()


if __name__ == "__main__":
    main()
