"""The shims bench/engine_runner.py installs in vLLM 0.32's CPU build, in its own process only.

vLLM's CPU build runs none of eprt's quantized exports as it ships. Each shim is the smallest change
that lets it run one format, with vLLM's own numerics wherever vLLM has them: a kernel vLLM lists for
other platforms registered for the CPU, or a routed-experts forward whose GEMMs vLLM runs in Triton
done as torch matmuls (docs/engine-check.md, "The shims", and what they still cannot run).
"""

from __future__ import annotations

import torch

NVFP4_BLOCK = 16
FP8_MAX = 448.0


def register_emulation_linear_kernels() -> None:
    """NVFP4 and MXFP8 Linears: vLLM lists its software kernels for them (EmulationNvFp4LinearKernel:
    the activation fake-quantized to NVFP4 with the input scale, the weight dequantized, bf16 matmul;
    EmulationMxfp8LinearKernel: the weight dequantized to bf16 at load, the activation left in bf16)
    for CUDA and ROCm only; on the CPU the kernel choice finds nothing and the load fails. Register
    vLLM's own kernels for the CPU platform."""
    from vllm.model_executor.kernels.linear import register_linear_kernel
    from vllm.model_executor.kernels.linear.mxfp8.emulation import EmulationMxfp8LinearKernel
    from vllm.model_executor.kernels.linear.nvfp4.emulation import EmulationNvFp4LinearKernel
    from vllm.platforms import PlatformEnum

    register_linear_kernel(EmulationNvFp4LinearKernel, PlatformEnum.CPU, "nvfp4")
    register_linear_kernel(EmulationMxfp8LinearKernel, PlatformEnum.CPU, "mxfp8")


# Set to a list by bench/engine_runner.py while it records: each routed-experts call appends, per
# expert it ran, the tokens it took and its two GEMMs' results (`experts_in_torch`).
RECORDED: list | None = None


def experts_in_torch(experts, output, x_TD, topk_weights, topk_ids, activation, gate_up, down) -> None:
    """A routed-experts forward as vLLM's Triton MoE computes it, in torch matmuls: each expert's
    gate/up GEMM over its tokens (fp32 accumulation, rounded to the model dtype), vLLM's own activation,
    the down GEMM, the router weight applied in fp32 and rounded, then the top-k outputs summed.
    gate_up(e, rows, x) and down(e, h) are one expert's GEMMs, its format's numerics inside (rows: the
    token of each row of x, for inputs quantized per token before the call)."""
    dtype = output.dtype
    out_TKD = torch.zeros(*topk_ids.shape, output.size(-1), dtype=torch.float32)
    call = {}
    for e in topk_ids.unique().tolist():
        rows_t, rows_k = (topk_ids == e).nonzero(as_tuple=True)
        h = gate_up(e, rows_t, x_TD[rows_t]).to(dtype)
        act = torch.empty(h.size(0), experts.adjust_N_for_activation(h.size(1), activation), dtype=dtype)
        experts.activation(activation, act, h)
        y = down(e, act)
        call[e] = {"tokens": rows_t.tolist(), "gate_up": h.float().tolist(), "act": act.float().tolist()}
        call[e]["down"] = y.tolist()
        out_TKD[rows_t, rows_k] = (y * topk_weights[rows_t, rows_k].float()[:, None]).to(dtype).float()
    output.copy_(out_TKD.sum(dim=1).to(dtype))
    if RECORDED is not None:
        RECORDED.append(call)


def replace_experts_forward(cls, forward) -> None:
    """Let an experts class load on the CPU and run `forward(self, output, hidden_states, w1, w2,
    topk_weights, topk_ids, activation, a1q_scale, a2_scale)` in place of its Triton apply. vLLM calls
    apply with keywords; what the forward does not take (workspaces, expert metadata) is unused. A
    router weight applied on the input (Llama-4's top-1 score scaling the expert's input) is already in
    hidden_states (vLLM's prepare step multiplies it in before the input quantization), so the
    forward sums the experts' outputs unweighted, as vLLM's Triton kernel does then."""

    def apply(self, *, expert_map, apply_router_weight_on_input, **kw):
        assert expert_map is None, "one rank"
        if apply_router_weight_on_input:
            kw["topk_weights"] = torch.ones_like(kw["topk_weights"])
        for unused in ("global_num_experts", "workspace13", "workspace2", "expert_tokens_meta"):
            kw.pop(unused)
        forward(self, **kw)

    cls.apply = apply
    cls._supports_current_device = staticmethod(lambda: True)


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

    def forward(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, a1q_scale, a2_scale):
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
            lambda e, _rows, x: x.float() @ weight(w1[e], self.w1_scale_val[e], qc.g1_alphas[e]).t(),
            lambda e, h: qdq(h, qc.a2_gscale).float() @ weight(w2[e], self.w2_scale_val[e], qc.g2_alphas[e]).t(),
        )

    replace_experts_forward(emulation.Nvfp4QuantizationEmulationTritonExperts, forward)


def run_triton_experts_in_torch() -> None:
    """Routed experts on vLLM's Triton MoE (TritonExperts): per-tensor and per-channel FP8 experts, and
    the emulation experts that hand it bf16 weights they dequantized (INT4 and MXFP8). vLLM's CPU MoE
    backends take block-FP8 experts only (INT4 ones on AMX CPUs), and the Triton experts declare
    themselves for CUDA and XPU only. Let them load on the CPU and run their forward as torch matmuls
    (experts_in_torch): bf16 weights and inputs as they come; FP8 on the dequantized values, the input
    as vLLM quantized it before the call (by the static input_scale, W8A8 as on a GPU, or per token at
    run time for per-channel weights), the down input by vLLM's own moe_kernel_quantize_input."""
    from vllm.model_executor.layers.fused_moe.experts import triton_moe
    from vllm.model_executor.layers.fused_moe.utils import moe_kernel_quantize_input
    from vllm.model_executor.layers.quantization.utils.quant_utils import (
        kFp8DynamicTokenSym,
        kFp8StaticChannelSym,
        kFp8StaticTensorSym,
        kFp8StaticTokenSym,
    )

    def forward(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, a1q_scale, a2_scale):
        qc = self.quant_config
        if w1.element_size() >= 2:  # bf16 weights (an emulation's), bf16 inputs

            def bf16(w):
                return lambda e, *x: x[-1].float() @ w[e].float().t()

            assert a1q_scale is None and a2_scale is None, "bf16 weights take bf16 inputs"
            return experts_in_torch(self, output, hidden_states, topk_weights, topk_ids, activation, bf16(w1), bf16(w2))
        assert qc.use_fp8_w8a8 and qc.block_shape is None, "per-tensor or per-channel FP8 only"
        token_scale = a1q_scale is not None and a1q_scale.numel() > 1  # one per token: [T, 1]

        def dequantized(w, scale):  # a per-tensor scale, or one per row ([N] or [N, 1])
            return w.float() * (scale.float().reshape(-1, 1) if scale.numel() > 1 else scale.float())

        def gate_up(e, rows, xe):
            if a1q_scale is not None:
                xe = xe * (a1q_scale.float()[rows] if token_scale else a1q_scale.float())
            return xe @ dequantized(w1[e], qc.w1_scale[e]).t()

        def down(e, h):
            h_q, h_scale = moe_kernel_quantize_input(
                A=h, A_scale=a2_scale, quant_dtype=qc.quant_dtype, per_act_token_quant=qc.per_act_token_quant
            )
            return (h_q.float() * h_scale.float()) @ dequantized(w2[e], qc.w2_scale[e]).t()

        experts_in_torch(self, output, hidden_states.float(), topk_weights, topk_ids, activation, gate_up, down)

    replace_experts_forward(triton_moe.TritonExperts, forward)
    # vLLM's CPU platform says it has no FP8 (supports_fp8), which the Triton experts read as "no FP8
    # scheme": accept the schemes the forward above runs, static per-tensor weights and inputs, and
    # per-channel weights with per-token dynamic inputs.
    schemes = {
        (kFp8StaticTensorSym, kFp8StaticTensorSym),
        (kFp8StaticChannelSym, kFp8DynamicTokenSym),
        (kFp8StaticTokenSym, kFp8DynamicTokenSym),
    }
    triton_moe.TritonExperts._supports_quant_scheme = staticmethod(lambda w, a: (w, a) in schemes)


def add_int4_emulation_experts() -> None:
    """INT4 routed experts (W4A16): vLLM's CPU INT4 experts (CPUExpertsInt4) need AMX tiles, and its
    emulation experts (Int4EmulationTritonExperts: the weights dequantized to bf16 at load, the inputs
    left in bf16, then the Triton MoE) are not among the CPU's WNA16 MoE backends. Add the emulation
    backend after the CPU's own and let it load on the CPU; its Triton MoE runs in torch
    (run_triton_experts_in_torch)."""
    from vllm.model_executor.layers.fused_moe.experts.int4_emulation_moe import Int4EmulationTritonExperts
    from vllm.model_executor.layers.fused_moe.oracle import int_wna16

    priority = int_wna16._get_priority_backends
    int_wna16._get_priority_backends = lambda: [*priority(), int_wna16.WNA16MoEBackend.EMULATION]
    Int4EmulationTritonExperts._supports_current_device = staticmethod(lambda: True)


def fp8_quant_in_torch() -> None:
    """FP8 with a static per-tensor scale, and dynamic per token: vLLM's scaled_fp8_quant calls the
    compiled static_scaled_fp8_quant and dynamic_per_token_scaled_fp8_quant, which the CPU build
    declares without arguments. The FP8 loader needs the first to requantize a fused module (q/k/v, an
    expert's gate/up) to its largest member scale, the per-channel FP8 kernels the second to quantize
    their inputs. Run those two cases in torch as vLLM's CUDA kernels compute them (static: x / scale;
    per token: each row under max(amax / 448, 1 / (448 x 512)), its amax capped by scale_ub; saturated
    to +-448, rounded to E4M3 once), every other case as before."""
    from vllm import _custom_ops as ops

    compiled = ops.scaled_fp8_quant

    def scaled_fp8_quant(
        input,
        scale=None,
        num_token_padding=None,
        scale_ub=None,
        use_per_token_if_dynamic=False,
        output=None,
        group_shape=None,
    ):
        per_token = scale is None and use_per_token_if_dynamic
        if num_token_padding or not (per_token or (scale is not None and scale.numel() == 1)):
            return compiled(input, scale, num_token_padding, scale_ub, use_per_token_if_dynamic, output, group_shape)
        x = input.float()
        if per_token:
            amax = x.abs().amax(dim=-1, keepdim=True)
            amax = amax.clamp(max=scale_ub.float()) if scale_ub is not None else amax
            scale = (amax / FP8_MAX).clamp(min=1.0 / (FP8_MAX * 512.0))
        q = (x / scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        if output is None:
            return q, scale
        output.copy_(q)
        return output, scale

    ops.scaled_fp8_quant = scaled_fp8_quant


def route_sigmoid_as_one_group() -> None:
    """A sigmoid router without expert groups (MiniMax-M2, MiniMax-M3: sigmoid scores, the correction
    bias choosing the top-k): vLLM's CPU router runs such a router only through its grouped top-k, and
    asserts softmax scoring otherwise. A single group is the same routing (the one group always kept,
    the top-k of every expert): run it through vLLM's own `_grouped_topk` with one group."""
    from vllm.model_executor.layers.fused_moe.router import cpu_router

    compute = cpu_router.CPURouter._compute_routing

    def compute_routing(self, hidden_states, router_logits, indices_type, *, input_ids=None):
        if self.use_grouped_topk or self.scoring_func != "sigmoid" or self.custom_routing_function is not None:
            return compute(self, hidden_states, router_logits, indices_type, input_ids=input_ids)
        return cpu_router._grouped_topk(
            gating_output=router_logits,
            topk=self.top_k,
            renormalize=self.renormalize,
            num_expert_group=1,
            topk_group=1,
            scoring_func=self.scoring_func,
            routed_scaling_factor=self.routed_scaling_factor,
            e_score_correction_bias=self.e_score_correction_bias,
        )

    cpu_router.CPURouter._compute_routing = compute_routing


SHIMS = [
    register_emulation_linear_kernels,
    run_nvfp4_emulation_experts_in_torch,
    fp8_quant_in_torch,
    run_triton_experts_in_torch,
    add_int4_emulation_experts,
    route_sigmoid_as_one_group,
]
