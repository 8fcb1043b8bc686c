"""The model card (`README.md`) a quantized export carries in place of the source's: the base model,
the recipe and its formats, the quality figures of the run, the GPU generations that serve it and
the commands that serve it in each engine that loads its layout (eprt.hf.serving).

The card holds nothing of the machine or the run's layout (no path, date or world size), so an
export is the same bytes wherever and however it was calibrated.
"""

from __future__ import annotations

import os
import re

import eprt
from eprt.hf.serving import LAYOUT_NAMES, MODELOPT, describe_gpus, engines_for, runs_on, served
from eprt.quant.recipe import Recipe

# a Hugging Face Hub repository id, and the cache directory that holds one (models--ORG--NAME)
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_CACHE = re.compile(r"models--([\w.-]+?)--([\w.-]+)(?:/|$)")


def base_model_id(source_config: dict, source_dir: str | None) -> str | None:
    """The Hub id of the model a checkpoint was made from, where the source says it: its config's
    `_name_or_path`, or the Hugging Face cache directory it was read from in place (`source_dir`)."""
    named = source_config.get("_name_or_path")
    if isinstance(named, str) and HUB_ID.match(named):
        return named
    found = HUB_CACHE.search(source_dir or "")
    return f"{found.group(1)}/{found.group(2)}" if found else None


def serve_commands(layout: str, formats: list[str], kv_cache: str | None, remote_code: bool) -> list[str]:
    """The command each engine that loads this export serves it with, on $GPUS GPUs of one node,
    the routed experts spread over them."""
    trust = remote_code
    commands = {
        "vllm": "vllm serve $MODEL --tensor-parallel-size $GPUS --enable-expert-parallel"
        + (" --kv-cache-dtype fp8" if kv_cache == "fp8" else "")
        + (" --trust-remote-code" if trust else ""),
        "sglang": "python -m sglang.launch_server --model-path $MODEL --tp $GPUS --ep-size $GPUS"
        + (" --quantization modelopt_fp4" if layout == MODELOPT and "nvfp4" in formats else "")
        + (" --kv-cache-dtype fp8_e4m3" if kv_cache == "fp8" else "")
        + (" --trust-remote-code" if trust else ""),
        "tensorrt-llm": "trtllm-serve $MODEL --backend pytorch --tp_size $GPUS --ep_size $GPUS"
        + (" --trust_remote_code" if trust else ""),
    }
    return [commands[e] for e in engines_for(formats, layout)]


def model_card(
    source_config: dict,
    recipe: Recipe,
    layout: str,
    quantized: set[str],
    base_model: str | None,
    quality: dict | None = None,
    quantization: dict | None = None,
) -> str:
    """The card of the export of a model (its source's `source_config`) under `recipe` in `layout`
    (`quantized`: its quantized modules), with the run's quality report and calibration record
    (`quantization`) where it was calibrated."""
    formats = recipe.formats
    name = base_model or source_config.get("model_type", "model")
    front = ["---"]
    if base_model:
        front += [f"base_model: {base_model}", "base_model_relation: quantized"]
    front += ["tags:", "- eprt", f"- {layout}", *(f"- {f}" for f in formats), "---", ""]
    native, weight_only = runs_on(formats)
    kv = f", KV cache {recipe.kv_cache}" if recipe.kv_cache else ""
    lines = [
        f"# {name}, {recipe.name}",
        "",
        f"{name} quantized by eprt {eprt.__version__} with the recipe `{recipe.name}` ({', '.join(formats)}{kv}), "
        f"in the {LAYOUT_NAMES[layout]} layout.",
        "",
        "## Formats",
        "",
        "| modules | count | format | weights, inputs |",
        "|---|---|---|---|",
        *(
            f"| `{group}` | {count} | {fmt} | {served(fmt).weights} |"
            for (group, fmt), count in module_groups(recipe, quantized).items()
        ),
        "",
        "Every other module (embeddings, `lm_head`, norms, routers, and those the recipe leaves out) stays as "
        "the source holds it.",
        "",
        "## GPUs",
        "",
        f"Runs as calibrated on {describe_gpus(formats)}."
        if native
        else f"No single GPU generation runs all of {', '.join(formats)} as calibrated.",
        *(
            [f"{', '.join(g.capitalize() for g in weight_only)}: through weight-only kernels (bf16 inputs)."]
            if weight_only
            else []
        ),
        "",
        "## Serve",
        "",
        "```bash",
        "MODEL=.   # this folder, or its Hub repository id once uploaded",
        "GPUS=8    # GPUs of one node",
        *serve_commands(layout, formats, recipe.kv_cache, "auto_map" in source_config),
        "```",
        "",
        *quality_section(quality, quantization),
        f"Made with eprt {eprt.__version__} (its guide to serving: `eprt-docs quickstart`).",
        "",
    ]
    return "\n".join(front + lines)


def module_groups(recipe: Recipe, quantized: set[str]) -> dict[tuple[str, str], int]:
    """(module name with its layer index left out, format) -> how many modules, in name order."""
    groups: dict[tuple[str, str], int] = {}
    for m in sorted(quantized):
        key = (re.sub(r"\.layers\.\d+\.", ".layers.*.", m), recipe.format_of(m))
        groups[key] = groups.get(key, 0) + 1
    return groups


def quality_section(quality: dict | None, quantization: dict | None) -> list[str]:
    """The run's figures on its held-out data, and what it calibrated on."""
    out = ["## Quality", ""]
    if quality is None:
        out += [
            "No quality report: the recipe takes no activation statistic, so no data was read (a data-free run).",
            "",
        ]
        return out
    ppl = quality["perplexity"]
    out += [
        f"On {quality['eval']['tokens']} held-out tokens ({os.path.basename(str(quality['eval'].get('data')))}), "
        "the quantized model against the unquantized one:",
        "",
        "| KL mean | KL p99 | top-1 agreement | perplexity |",
        "|---|---|---|---|",
        f"| {quality['kl_mean']:.4g} | {quality['kl_p99']:.4g} | {100 * quality['top1_agreement']:.2f}% | "
        f"{ppl['unquantized']:.4g} -> {ppl['quantized']:.4g} |",
        "",
    ]
    calib = (quantization or {}).get("calibration") or {}
    if calib.get("tokens"):
        data = ", ".join(os.path.basename(s["path"]) for s in calib.get("sources", [])) or calib.get("data")
        out += [
            f"Calibrated ({calib.get('algorithm')}) on {calib['samples']} sequences of {calib['seq_len']} tokens "
            f"from {data}; eprt_quality.html in this folder holds the whole report.",
            "",
        ]
    return out
