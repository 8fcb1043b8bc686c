"""What an export loads into correctly but an engine then computes wrong, said as warnings: the
export passes its checks (eprt.hf.check_export), and the way out is a recipe that avoids it.

vLLM 0.32's MLA (DeepSeek-V3, Kimi-K2/K3 and Kimi-Linear's MLA layers) absorbs `kv_b_proj` into
the attention at load time by running the layer on an identity matrix. Under a format that
quantizes its inputs to 4 bits (NVFP4 W4A4), each 1.0 of that matrix is quantized too: its block's
scale is e4m3(gs / 6) for the layer's global input scale gs = 1 / input_scale, the 1.0 becomes the
code 6, so every absorbed weight comes out multiplied by 6 x e4m3(gs / 6) / gs (the GEMM scales the
code back by the block scale and input_scale), then rounded to bf16: x1.008 measured, and anywhere
within E4M3's rounding, about +-6%, depending on input_scale.

transformers 5 decompresses a compressed-tensors export's NVFP4 routed experts without their
weight_global_scale (its fused-experts path builds a module of weight_packed and weight_scale only),
so every expert weight it loads is global_scale times too large: the export is right (vLLM and the
compressed-tensors library decode it), but a check in transformers is not one.

The engines fuse Linears that read one input (q/k/v, gate/up, MLA's q_a_proj with
kv_a_proj_with_mqa) and, in a format of row blocks (FP8 block's 128x128), stack the members' block
scales into the fused weight's. A member whose row count is not a multiple of the block ends in a
partial block row: the rows after it in the fused weight no longer start a block, and an engine
that counts a member's scale rows as rows // 128 leaves the last one unread (GLM-5.3's 576-row
kv_a_proj_with_mqa decoded to noise in an engine so).

vLLM 0.32's GPT-OSS class loads quantized routed experts only as the release stores them (MXFP4
`gate_up_proj_blocks`/`_scales`, quant_method mxfp4: what `--format mxfp4` writes, eprt.hf.mxfp4_blocks_export) or as Quark writes them: its loader maps
per-expert tensors by the suffixes `gate_up_proj.weight`, `.weight_scale` and `.bias` alone, and
the MoE methods of ModelOpt (FP8, NVFP4, MXFP8) and of compressed-tensors' float formats hold no
expert biases, which GPT-OSS's experts have. An export with quantized GPT-OSS experts fails to load
there (FP8: no parameter for the bias; NVFP4: no MoE backend takes a bias) or, for compressed-
tensors' INT4, whose method holds the biases, loads without its expert weights (`weight_packed`
reaches no parameter, and vLLM checks a quantized model's parameters only when asked).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from eprt.hf.check_export import ct_formats, is_compressed_tensors
from eprt.hf.check_files import read_json, read_tensors
from eprt.hf.check_modelopt import SAME_INPUT, ModelOptModules
from eprt.hf.check_mxfp4_blocks import is_mxfp4_blocks
from eprt.hf.check_quant_config import MIXED, check_configs, quantized_layers
from eprt.quant.absorbed import absorbed_in_4_bit_inputs
from eprt.quant.formats.e2m1 import E2M1_MAX
from eprt.storage.hf_files import CONFIG, QUANT_CONFIG


def absorbed_factor(input_scale: float) -> float:
    """What vLLM's identity-matrix absorption multiplies a W4A4 kv_b_proj's weights by, for its
    input_scale: a 1.0 quantized under block scale e4m3(1 / (6 x input_scale)) is the code 6, which
    the GEMM scales back by that block scale and input_scale, in fp32 (6 x the block scale is exact)."""
    scale = np.float32(input_scale)
    block = torch.tensor(float(np.float32(1.0) / (np.float32(E2M1_MAX) * scale))).to(torch.float8_e4m3fn).item()
    return float(np.float32(E2M1_MAX * block) * scale)


def transformers_misreads(formats: dict) -> list[str]:
    """A line where transformers does not decode a compressed-tensors export as engines do: NVFP4
    routed experts (`formats`: module -> format)."""
    experts = sorted(m for m, f in formats.items() if ".experts." in f".{m}." and f.name == "nvfp4")
    if not experts:
        return []
    return [
        f"{len(experts)} NVFP4 routed expert projections ({experts[0]}, ...): transformers 5 decompresses them "
        "without their weight_global_scale, so the model it loads from this export is wrong, though the export is "
        "right; verify it in vLLM, which loads it as written, or with the compressed-tensors library's own "
        "decompression"
    ]


def partial_fused_row_blocks(formats: dict, tensors: dict) -> list[str]:
    """A line where a Linear stored in row blocks (`formats`: module -> format) is fused on load with
    a sibling of its format and has a row count that is not a multiple of the block height."""
    partial: dict[str, tuple[int, tuple[str, ...]]] = {}
    for module, fmt in formats.items():
        parent, _, leaf = module.rpartition(".")
        group = next((g for g in SAME_INPUT if leaf in g), ())
        fused = any(formats.get(f"{parent}.{x}") is fmt for x in group if x != leaf)
        weight = tensors.get(f"{module}.weight")
        if fmt.blocks_span_rows and fused and weight is not None and weight.shape[0] % fmt.scale_height:
            partial[module] = weight.shape[0], group
    if not partial:
        return []
    first = min(partial)
    rows, group = partial[first]
    kinds = sorted({f"{m.rpartition('.')[2]} ({r} rows)" for m, (r, _) in partial.items()})
    height, name = formats[first].scale_height, formats[first].name
    rules = ", ".join(f'{{pattern: "*.{x}", format: fp8_channel}}' for x in group)
    return [
        f"{len(partial)} {name} Linears the engines fuse with a sibling have a row count that is not a multiple "
        f"of the {height}-row block ({first}: {rows} rows, fused with {'/'.join(group)}; {', '.join(kinds)}): "
        f"the fused weight stacks the members' block scales, so a partial last block row shifts the rows after "
        f"it or is left unread by an engine that counts rows // {height} (noise in the output); check the "
        "engine's output against the source, or quantize that fused group in a format without row blocks "
        f"(recipe rules {rules})"
    ]


def unloaded_gpt_oss_experts(config: dict, formats: dict, layout: str) -> list[str]:
    """A line where a GPT-OSS export (`config`) holds quantized routed experts (`formats`: module ->
    format), which vLLM 0.32 does not load in `layout`."""
    experts = sorted(m for m in formats if ".experts." in f"{m}.")
    if config.get("model_type") != "gpt_oss" or not experts:
        return []
    return [
        f"{len(experts)} GPT-OSS routed expert projections are quantized ({experts[0]}, ...): vLLM 0.32's GPT-OSS "
        f"loader reads quantized experts only in the release's MXFP4 blocks or Quark's spelling, and its {layout} "
        "MoE methods either hold no expert biases (FP8, NVFP4, MXFP8: the load fails) or are reached by none of "
        "the per-expert tensors (INT4: vLLM runs the model without its expert weights); for vLLM, quantize the "
        "routed experts alone in MXFP4 (recipe mxfp4_experts_only) and export with --format mxfp4, the release's "
        "layout, or serve it with an engine that loads per-expert experts with their biases"
    ]


def engine_warnings(out_dir) -> list[str]:
    """One line per engine quirk the export at `out_dir` runs into: MLA kv_b_projs in a W4A4 format,
    a compressed-tensors layout that transformers decodes otherwise than the engines, fused Linears
    in row blocks that end in a partial one, and GPT-OSS experts quantized where vLLM does not load them. None where its files cannot be read (the checks
    say why)."""
    out = Path(out_dir)
    problems: list[str] = []
    config = read_json(out / CONFIG, problems)
    tensors = read_tensors(out, problems)
    if problems or not tensors or is_mxfp4_blocks(config):  # the release's layout: loaded as the release is
        return []
    warnings = []
    if is_compressed_tensors(config):
        formats = ct_formats(tensors)
        input_leaf = {m: f.ct_input_scale_leaf for m, f in formats.items()}
        warnings += transformers_misreads(formats) + unloaded_gpt_oss_experts(config, formats, "compressed-tensors")
    else:
        hf_quant = read_json(out / QUANT_CONFIG, problems)
        algo, _, exclude = check_configs(config, hf_quant, problems)
        if algo is None:
            return []
        layers = quantized_layers(config, hf_quant) if algo == MIXED else None
        formats = ModelOptModules(tensors, algo, exclude, problems, layers).format_of
        input_leaf = {m: f.modelopt_per_tensor_scales[1] for m, f in formats.items()}
        warnings += unloaded_gpt_oss_experts(config, formats, "ModelOpt")
    warnings += partial_fused_row_blocks(formats, tensors)
    factors = {}
    for module, fmt in formats.items():
        stored = tensors.get(f"{module}.{input_leaf[module]}") if input_leaf[module] else None
        if absorbed_in_4_bit_inputs(module, fmt) and stored is not None and stored.value:
            # compressed-tensors stores the global scale itself, ModelOpt its reciprocal
            reciprocal = is_compressed_tensors(config) and fmt.ct_reciprocal
            factors[module] = absorbed_factor(1 / stored.value if reciprocal else stored.value)
    if not factors:
        return warnings
    low, high = min(factors, key=factors.get), max(factors, key=factors.get)
    return warnings + [
        f"{len(factors)} MLA kv_b_proj in a W4A4 format ({formats[low].quant_algo}): vLLM 0.32 absorbs kv_b_proj "
        f"by running it on an identity matrix, which quantizes those 1.0s too, so the absorbed weights come out "
        f"scaled by 6 x e4m3(gs/6)/gs (gs = 1/input_scale): x{factors[low]:.4f} ({low}) to x{factors[high]:.4f} "
        f"({high}), then rounded to bf16; keep kv_b_proj out of W4A4 (recipe rule "
        '{pattern: "*.kv_b_proj", format: none}, or nvfp4_a16 for it), as the shipped recipes do'
    ]
