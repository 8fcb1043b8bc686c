"""The reference side of bench/engine_check.py: an export's tensors dequantized from the numerics
docs/export.md states (not by eprt's code), and its modules' inputs quantized as the engine's kernel
quantizes them.

Every quantized Linear of an export, in either layout, is read into a `Module`: its weight in fp32
and what the engine may do with its input (`InputQuant`). The formats are told apart by their
tensors, as the engines' loaders tell them: packed NVFP4 / MXFP4 / INT4 codes, FP8 codes with a
per-tensor, per-row, 128x128-block or E8M0 scale.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass

import torch
from safetensors.torch import load_file

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2
FP8_MAX, FP4_MAX = 448.0, 6.0
NVFP4_BLOCK, MX_BLOCK, FP8_BLOCK = 16, 32, 128
E8M0_BIAS = 127
# Scales, not weights: dropped from the reference checkpoint once their weight is dequantized.
SCALE_LEAVES = {
    "weight_scale",
    "weight_scale_2",
    "input_scale",
    "weight_global_scale",
    "input_global_scale",
    "weight_shape",
    "k_scale",
    "v_scale",
}


def e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round to E4M3, saturating at +-448, back in fp32."""
    return x.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def e2m1(y: torch.Tensor) -> torch.Tensor:
    """Round to the nearest E2M1 value, a tie to the even index, saturating at 6 (signed)."""
    a = y.abs().clamp(max=FP4_MAX)
    below = torch.bucketize(a, E2M1_MIDPOINTS, right=False)  # midpoints strictly below a
    upto = torch.bucketize(a, E2M1_MIDPOINTS, right=True)  # midpoints at or below a
    index = torch.where((upto != below) & (below % 2 == 1), upto, below)
    return E2M1[index] * torch.where(y < 0, -1.0, 1.0)


def e2m1_codes(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in/2], element 2j in the low nibble; code = sign bit 3, E2M1 index bits 0-2."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()
    return E2M1[nibbles & 7] * torch.where(nibbles & 8 != 0, -1.0, 1.0)


def by_blocks(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values [out, in] x scale [out, in/b], each scale over b consecutive inputs."""
    return (values.view(*scale.shape, -1) * scale[..., None]).flatten(-2)


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, scale_2: float) -> torch.Tensor:
    """E2M1 value x float(E4M3 block scale of 16) x weight_scale_2."""
    return by_blocks(e2m1_codes(packed), block_scale.float() * scale_2)


def e8m0(scale: torch.Tensor) -> torch.Tensor:
    """uint8 biased exponents as their powers of two, 2^(byte - 127)."""
    return torch.exp2(scale.float() - E8M0_BIAS)


def dequantize_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """int32 [out, in/8], element i of each eight in bits 4i..4i+3 as code + 8; code x bf16 group scale."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    codes = ((packed.unsqueeze(-1) >> shifts) & 0xF).flatten(-2).float() - 8
    return by_blocks(codes, scale.float())


def dequantize_fp8_blocks(weight: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """E4M3 [out, in] x its 128x128 block's scale, the grid [ceil(out/128), ceil(in/128)] spread
    over the blocks and cut to the weight (the edge blocks are partial)."""
    out, inp = weight.shape
    spread = grid.float().repeat_interleave(FP8_BLOCK, 0).repeat_interleave(FP8_BLOCK, 1)
    return weight.float() * spread[:out, :inp]


@dataclass(frozen=True)
class InputQuant:
    """What a W8A8 / W4A4 engine kernel may do with a module's input: `static` FP8 or NVFP4 under the
    export's input scale, or FP8 under a scale of its own per `group` inputs of each token (group 0:
    the whole token)."""

    kind: str  # "fp8-static", "nvfp4", "fp8-dynamic", "mxfp8"
    scale: float = 0.0  # the export's input scale (static kinds)
    group: int = 0  # fp8-dynamic: inputs a scale covers, 0 for the whole token
    # nvfp4: the global scale the engine's kernel multiplies by, fp32, as its loader derives it from
    # the export (a Linear's: 1 / input_scale, or compressed-tensors' input_global_scale as stored)
    global_scale: float = 0.0


def fp32_reciprocal(v: float) -> float:
    """1 / v rounded once to fp32, as the engines' loaders invert a stored fp32 scale."""
    return (1.0 / torch.tensor(v, dtype=torch.float32)).item()


def nvfp4_input(input_scale: float, global_scale: float | None = None) -> InputQuant:
    """An NVFP4 input under `input_scale` (fp32); its global scale fp32 1 / input_scale unless given."""
    return InputQuant(
        "nvfp4", input_scale, global_scale=fp32_reciprocal(input_scale) if global_scale is None else global_scale
    )


@dataclass
class Module:
    fmt: str  # the table's format name
    weight: torch.Tensor  # fp32 [out, in]
    inputs: InputQuant | None  # what a quantizing kernel does with the input; None: weights only
    tensor_scale: float = 0.0  # per-tensor FP8's weight_scale
    bias: torch.Tensor | None = None  # the Linear's bias as stored (GLM-4.5's q/k/v)


def fake_quantize(x: torch.Tensor, q: InputQuant) -> torch.Tensor:
    """An input as a W8A8 / W4A4 kernel sees it, rounded to x's dtype (`quantize_dequantize`)."""
    return quantize_dequantize(x, q).to(x.dtype)


# The generator of `jittered_inputs`, while one is active: every quantized input then moves first.
_jitter: torch.Generator | None = None


@contextlib.contextmanager
def jittered_inputs(seed: int):
    """Within the block, every input a W8A8 / W4A4 kernel quantizes (`quantize_dequantize`) first
    moves by one bf16 step, up or down, on a random half of its elements: the disagreement an engine
    and the reference have where they round the same value in different places (the engine check's
    noise floor, docs/engine-check.md, "Tolerances")."""
    global _jitter
    _jitter = torch.Generator().manual_seed(seed)
    try:
        yield
    finally:
        _jitter = None


def bf16_steps(x: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """x (bf16 values) with a random half of its nonzero elements moved one bf16 step up or down."""
    bits = x.to(torch.bfloat16).view(torch.int16)
    step = torch.randint(0, 2, bits.shape, generator=generator, dtype=torch.int16) * 2 - 1
    moved = (torch.rand(bits.shape, generator=generator) < 0.5) & (bits & 0x7FFF != 0)
    return torch.where(moved, bits + step, bits).view(torch.bfloat16).to(x.dtype)


def quantize_dequantize(x: torch.Tensor, q: InputQuant, fp8_by_reciprocal: bool = False) -> torch.Tensor:
    """An input quantized and dequantized as a W8A8 / W4A4 kernel does, in fp32.
    fp8-static: e4m3(x / s) s. nvfp4: `nvfp4_quantize_dequantize`. fp8-dynamic: each group of a token
    under amax / 448 (at least 1 / (448 x 512)). mxfp8: each 32-block under 2^ceil(log2(amax / 448)),
    the export's own exponent rule. `fp8_by_reciprocal`: x * fp32(1 / s) in place of x / s, as vLLM's
    FP8 Linears quantize their input in torch (QuantFP8's native path); the two round apart where
    the quotient lands on an E4M3 midpoint."""
    xf = x.float() if _jitter is None else bf16_steps(x, _jitter).float()
    if q.kind == "nvfp4":
        return nvfp4_quantize_dequantize(xf, q.global_scale)
    if q.kind == "fp8-static":
        s = torch.tensor(q.scale, dtype=torch.float32)
    else:
        group = {"fp8-dynamic": q.group or xf.shape[-1], "mxfp8": MX_BLOCK}[q.kind]
        xf = xf.reshape(*xf.shape[:-1], -1, group)
        amax = xf.abs().amax(-1, keepdim=True)
        s = (
            (amax / FP8_MAX).clamp(min=1 / (FP8_MAX * 512))
            if q.kind == "fp8-dynamic"
            else torch.exp2(torch.ceil(torch.log2(amax.clamp(min=torch.finfo(torch.float32).tiny) / FP8_MAX)))
        )
    codes = e4m3(xf * s.reciprocal() if fp8_by_reciprocal else xf / s)
    return (codes * s).reshape(x.shape)


def engine_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    q: InputQuant | None,
    fp8_by_reciprocal: bool = True,
    dtype: torch.dtype | None = None,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """A quantized Linear's output in x's dtype as vLLM's kernel computes it, `q` what the kernel does
    with the input (None: weight-only), `weight` the dequantized fp32 weight. An FP8 W8A8 kernel
    quantizes the input (a Linear's by the scale's reciprocal; the routed experts' by division,
    `fp8_by_reciprocal=False`) and multiplies the E4M3 values of input and weight (torch._scaled_mm;
    the experts' fp32 GEMMs), scaling the fp32 sum once: both enter unrounded, only the output rounds.
    The others (vLLM's NVFP4 emulation, the weight-only kernels) multiply the input and the weight
    each in bf16 (docs/engine-check.md, "FP8 Linears"). `dtype` float32: the fp32 sum unrounded, as the
    routed experts' down GEMM leaves it for the router weight (bench/engine_shims.py). A `bias` is added
    to the sum before that rounding, as torch._scaled_mm and a bf16 matmul add it."""
    dtype = dtype or x.dtype
    if q is not None and q.kind.startswith("fp8"):
        b = None if bias is None else bias.float()
        return torch.nn.functional.linear(quantize_dequantize(x, q, fp8_by_reciprocal), weight, b).to(dtype)
    xq = x if q is None else fake_quantize(x, q)
    if dtype == torch.float32:
        return torch.nn.functional.linear(xq.float(), weight.float(), None if bias is None else bias.float())
    return torch.nn.functional.linear(xq, weight.to(x.dtype), None if bias is None else bias.to(x.dtype))


def engine_bf16(x: torch.Tensor) -> torch.Tensor:
    """fp32 x to bf16 as vLLM's CPU kernels convert their fp32 results: on a CPU with AVX-512 BF16,
    its conversion instruction (round to nearest even); on the others, by dropping the low 16 bits
    (rounding toward zero)."""
    if torch.cpu._is_avx512_bf16_supported():
        return x.float().to(torch.bfloat16)
    return (x.float().contiguous().view(torch.int32) >> 16).to(torch.int16).view(torch.bfloat16)


def silu_and_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The routed experts' activation as vLLM's CPU MoE computes it (its compiled `silu_and_mul`):
    silu(gate) * up in fp32, converted to bf16 once (`engine_bf16`). transformers rounds silu(gate)
    and the product each to nearest: half the elements land a bf16 step apart (docs/engine-check.md,
    "Activations"). vLLM's dense MLPs compute it as transformers does (torch's own ops)."""
    return engine_bf16(torch.nn.functional.silu(gate.float()) * up.float())


def nvfp4_quantize_dequantize(x: torch.Tensor, global_scale: float) -> torch.Tensor:
    """fp32 x by 16-element blocks in the engines' NVFP4 activation arithmetic (vLLM's emulation, as
    its CUDA quantization kernel): under the global scale g, block scale b = e4m3(g (amax / 6)) with no
    floor (a block that underflows E4M3 is zero), value E2M1(x * fp32(1 / (b * fp32(1 / g)))),
    dequantized as value * (b / g). In exact arithmetic that is export.md's block rule under
    input_scale = 1 / g, but bf16 inputs under few-bit scales land exactly on E2M1 midpoints often,
    and there the fp32 roundings of the reciprocals, not the rule, pick the side
    (docs/engine-check.md, "NVFP4 activations")."""
    g = torch.tensor(global_scale, dtype=torch.float32)
    blocks = x.reshape(*x.shape[:-1], -1, NVFP4_BLOCK)
    b = e4m3(g * (blocks.abs().amax(-1, keepdim=True) * (1 / FP4_MAX)))
    inverse = torch.where(b == 0, 0.0, 1 / (b * (1 / g)))
    return (e2m1(blocks * inverse) * (b / g)).reshape(x.shape)


def read_tensors(export: str) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(export)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(export, name)))
    return tensors


def fp8_module(module: str, weight: torch.Tensor, tensors: dict[str, torch.Tensor]) -> Module:
    """An FP8 Linear by its weight_scale: uint8 E8M0 per 32 (MXFP8), one value (per tensor, static
    input scale), one per row ([out] or [out, 1]), or the 128x128 grid (2-D, [1, 1] for one block)."""
    scale = tensors[f"{module}.weight_scale"]
    out, inp = weight.shape
    if scale.dtype == torch.uint8:
        return Module("MXFP8", by_blocks(weight.float(), e8m0(scale)), InputQuant("mxfp8"))
    if scale.dim() <= 1 and scale.numel() == 1:  # [] (ModelOpt) or [1]; a one-block grid is [1, 1]
        static = InputQuant("fp8-static", tensors[f"{module}.input_scale"].item())
        return Module("FP8", weight.float() * scale.item(), static, tensor_scale=scale.item())
    if scale.shape in {(out,), (out, 1)} and out > 1:
        return Module("FP8 channel", weight.float() * scale.float().view(out, 1), InputQuant("fp8-dynamic"))
    if scale.shape == (math.ceil(out / FP8_BLOCK), math.ceil(inp / FP8_BLOCK)):
        return Module("FP8 block", dequantize_fp8_blocks(weight, scale), InputQuant("fp8-dynamic", group=FP8_BLOCK))
    raise ValueError(f"{module}.weight_scale: shape {list(scale.shape)} fits no FP8 format of weight {[out, inp]}")


def read_module(module: str, leaf: str, t: torch.Tensor, tensors: dict[str, torch.Tensor]) -> Module | None:
    """The quantized Linear whose weight tensor is `module.leaf`, or None for any other tensor."""
    get = tensors.get
    if leaf == "weight_packed" and t.dtype == torch.int32:  # INT4 (W4A16, W4A8): pack-quantized
        return Module("INT4", dequantize_int4(t, tensors[f"{module}.weight_scale"]), InputQuant("fp8-dynamic"))
    if leaf == "weight_packed" and f"{module}.weight_global_scale" in tensors:  # compressed-tensors NVFP4
        w = dequantize_nvfp4(t, tensors[f"{module}.weight_scale"], 1.0 / get(f"{module}.weight_global_scale").item())
        gs = get(f"{module}.input_global_scale")  # the reciprocal of ModelOpt's input_scale; none for A16
        # vLLM's Linear quantizes under input_global_scale as stored; its MoE under 1 / (fp32 1 / it)
        return Module("NVFP4", w, None if gs is None else nvfp4_input(fp32_reciprocal(gs.item()), gs.item()))
    if leaf == "weight_packed":  # MXFP4: E2M1 codes x E8M0 per 32
        return Module("MXFP4", by_blocks(e2m1_codes(t), e8m0(tensors[f"{module}.weight_scale"])), None)
    if leaf == "weight" and t.dtype == torch.uint8:  # ModelOpt NVFP4 (W4A16: no input_scale)
        w = dequantize_nvfp4(t, tensors[f"{module}.weight_scale"], get(f"{module}.weight_scale_2").item())
        s = get(f"{module}.input_scale")
        return Module("NVFP4", w, None if s is None else nvfp4_input(s.item()))
    if leaf == "weight" and t.dtype == torch.float8_e4m3fn:
        return fp8_module(module, t, tensors)
    return None


def release_mxfp4_stacks(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-OSS's release layout (quant_method mxfp4): each stack of experts P stored as `P_blocks`
    [E, out, in/32, 16] and `P_scales` [E, out, in/32] (E2M1 x 2^(byte - 127) of its block of 32),
    decoded to the bf16 `P` [E, in, out] transformers holds; the other tensors as they are."""
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scales") and name.removesuffix("_scales") + "_blocks" in tensors:
            continue
        if name.endswith("_blocks"):
            stack = name.removesuffix("_blocks")
            scales = tensors[f"{stack}_scales"]
            values = by_blocks(e2m1_codes(t.flatten(-2)), e8m0(scales))  # [E, out, in]
            out[stack] = values.transpose(-2, -1).to(torch.bfloat16).contiguous()
        else:
            out[name] = t
    return out


def read_export(export: str) -> tuple[dict[str, torch.Tensor], dict[str, Module]]:
    """The export's tensors with each quantized Linear's weight dequantized to bf16 and its scales
    dropped, and each quantized module, in either layout (GPT-OSS's release layout: its stacks of
    experts decoded whole, weight-only in the engine, so no module of their own)."""
    tensors = release_mxfp4_stacks(read_tensors(export))
    weights, modules = {}, {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        found = read_module(module, leaf, t, tensors)
        if found is not None:
            modules[module] = found
        elif leaf not in SCALE_LEAVES:
            weights[name] = t
    requantize_fused_fp8(modules)
    for module, m in modules.items():
        weights[f"{module}.weight"] = m.weight.to(torch.bfloat16)
        m.bias = tensors.get(f"{module}.bias")
    return weights, modules


FUSED = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa")]


def fused_siblings(module: str) -> list[str]:
    """The Linears vLLM loads as one module with `module` (qkv_proj, gate_up_proj, fused_qkv_a_proj)."""
    prefix, _, leaf = module.rpartition(".")
    group = next((g for g in FUSED if leaf in g), (leaf,))
    return [f"{prefix}.{m}" for m in group]


def requantize_fused_fp8(modules: dict[str, Module]) -> None:
    """A fused per-tensor FP8 module holds one scale in the engine: each member requantized to the
    largest member scale (docs/export.md, "Amax and shared scales")."""
    scales = {name: m.tensor_scale for name, m in modules.items() if m.fmt == "FP8"}
    for name, scale in scales.items():
        fused = max(scales.get(s, scale) for s in fused_siblings(name))
        if scale < fused:
            modules[name].weight = e4m3(modules[name].weight / fused) * fused
