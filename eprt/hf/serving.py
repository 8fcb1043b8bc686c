"""Which GPUs and engines serve each weight format, in one table: README's format table is drawn from
it (`format_table`), `--target` checks or picks a recipe by it, and the model card and the summary
of eprt-quantize say from it which GPUs run an export and how each engine serves it.

A format runs on a generation natively (its kernels take the format's inputs as the recipe
quantized them) or through weight-only kernels (the engine dequantizes the weights and keeps bf16
inputs: it loads and runs, slower and without the activation format the recipe calibrated).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from eprt.errors import ConfigError
from eprt.storage.mxfp4_blocks import MXFP4_BLOCKS

GENERATIONS = ("ampere", "ada", "hopper", "blackwell")
# GPU names a user may give as --target, by generation (matched without case, spaces or dashes)
GPUS = {
    "ampere": ("A100", "A800", "A40", "A30", "A10", "A6000", "RTX 3090"),
    "ada": ("L40S", "L40", "L4", "RTX 4090", "RTX 6000 Ada"),
    "hopper": ("H100", "H200", "H800", "H20", "GH200"),
    "blackwell": ("B200", "B300", "GB200", "GB300", "B100", "RTX PRO 6000", "RTX 5090"),
}
# the memory of one GPU of each generation, in GB (10^9 bytes), for how many the weights need
GPU_MEMORY_GB = {"ampere": ("A100", 80), "ada": ("L40S", 48), "hopper": ("H200", 141), "blackwell": ("B200", 180)}
ENGINES = ("vllm", "sglang", "tensorrt-llm")
MODELOPT, COMPRESSED_TENSORS = "modelopt", "compressed-tensors"
LAYOUT_NAMES = {MODELOPT: "ModelOpt", COMPRESSED_TENSORS: "compressed-tensors", MXFP4_BLOCKS: "GPT-OSS release's MXFP4"}


@dataclass(frozen=True)
class Served:
    """One row of the table: a weight format (and the recipes named after it)."""

    formats: tuple[str, ...]  # the formats of eprt.quant.formats this row describes
    weights: str  # what the weights and inputs are
    native: tuple[str, ...]  # generations whose kernels run it as calibrated
    weight_only: tuple[str, ...]  # generations that run it through weight-only kernels
    engines: dict[str, tuple[str, ...]]  # export layout -> the engines that load it in that layout
    engines_text: str  # the table's engines column
    kernels: str = ""  # the kernels that run it, where the table names them

    def gpus_text(self) -> str:
        text = ", ".join(g.capitalize() for g in self.native)
        notes = [self.kernels] if self.kernels else []
        if self.weight_only:
            notes.append(f"{', '.join(g.capitalize() for g in self.weight_only)}: weight-only kernels")
        return text + (f" ({'; '.join(notes)})" if notes else "")


ALL = {MODELOPT: ENGINES, COMPRESSED_TENSORS: ENGINES}
TABLE = (
    Served(
        ("fp8",),
        "E4M3 per tensor, static per-tensor inputs",
        ("hopper", "ada", "blackwell"),
        ("ampere",),
        {MODELOPT: ENGINES, COMPRESSED_TENSORS: ("vllm", "sglang")},
        "vLLM, SGLang (both layouts); TensorRT-LLM's compressed-tensors loader refuses per-tensor FP8",
    ),
    Served(
        ("fp8_block",),
        "E4M3 in 128x128 blocks, inputs per token in groups of 128 at run time",
        ("hopper", "blackwell"),
        ("ampere",),
        ALL,
        "vLLM, SGLang, TensorRT-LLM: the format DeepSeek-V3, Qwen3 and Kimi-K2 ship",
    ),
    Served(
        ("fp8_channel",),
        "E4M3 with a scale per output channel, inputs per token at run time",
        ("hopper", "ada", "blackwell"),
        ("ampere",),
        {MODELOPT: ("vllm", "sglang"), COMPRESSED_TENSORS: ENGINES},
        "vLLM, SGLang; TensorRT-LLM through the compressed-tensors layout",
    ),
    Served(
        ("nvfp4",), "E2M1 in 16-element blocks, NVFP4 inputs", ("blackwell",), (), ALL, "vLLM, SGLang, TensorRT-LLM"
    ),
    Served(
        ("nvfp4_input_scale1",),
        "NVFP4's weights, NVFP4 inputs under a constant input scale of 1 (not calibrated)",
        ("blackwell",),
        (),
        ALL,
        "vLLM, SGLang, TensorRT-LLM",
    ),
    Served(
        ("nvfp4_a16",),
        "NVFP4's weights, bf16 inputs",
        ("ampere", "hopper", "blackwell"),
        (),
        {MODELOPT: ("vllm", "tensorrt-llm"), COMPRESSED_TENSORS: ("vllm", "tensorrt-llm")},
        "vLLM, TensorRT-LLM",
        "Marlin's FP4 kernels off Blackwell",
    ),
    Served(
        ("int4", "int4_g32"),
        "INT4 (-7..7) in groups of 128 or 32 with bf16 group scales, bf16 inputs; compressed-tensors layout only",
        ("ampere", "hopper"),
        (),
        {COMPRESSED_TENSORS: ("vllm", "sglang")},
        "vLLM, SGLang: the format the Kimi releases ship (groups of 32)",
        "Marlin kernels",
    ),
    Served(
        ("int4_full", "int4_g32_full"),
        "INT4 (-8..7, compressed-tensors' own grid) in groups of 128 or 32 with bf16 group scales, bf16 inputs; "
        "compressed-tensors layout only; the `int4` and `int4_g32` recipes write it for every source but a Kimi "
        "release stored in INT4",
        ("ampere", "hopper"),
        (),
        {COMPRESSED_TENSORS: ("vllm", "sglang")},
        "vLLM, SGLang",
        "Marlin kernels",
    ),
    Served(
        ("w4a8",),
        "INT4 in groups of 128, FP8 inputs per token at run time; compressed-tensors layout only",
        ("hopper",),
        (),
        {COMPRESSED_TENSORS: ("vllm", "sglang")},
        "vLLM, SGLang",
        "CUTLASS W4A8 kernels",
    ),
    Served(
        ("w4a8_full",),
        "INT4 (-8..7, compressed-tensors' own grid) in groups of 128, FP8 inputs per token at run time; "
        "compressed-tensors layout only; the `w4a8` recipe writes it for every source but a Kimi release stored in INT4",
        ("hopper",),
        (),
        {COMPRESSED_TENSORS: ("vllm", "sglang")},
        "vLLM, SGLang",
        "CUTLASS W4A8 kernels",
    ),
    Served(
        ("mxfp8",),
        "E4M3 with a power-of-two (E8M0) scale per 32 elements, inputs likewise at run time",
        ("blackwell",),
        (),
        {MODELOPT: ("vllm",), COMPRESSED_TENSORS: ("vllm",)},
        "vLLM (ModelOpt's `MXFP8` and compressed-tensors' `mxfp8-quantized`)",
    ),
    Served(
        ("mxfp4",),
        "E2M1 with an E8M0 scale per 32 elements, bf16 inputs; compressed-tensors layout only",
        ("blackwell",),
        (),
        {COMPRESSED_TENSORS: ("vllm",), MXFP4_BLOCKS: ("vllm",)},
        "vLLM: the format Kimi-K3 ships its experts in",
    ),
)
# what --target picks where no --recipe is given: the format each generation runs natively at
# the fewest bits with its activations quantized as calibrated (Ampere: 4-bit weights, bf16 inputs)
DEFAULT_RECIPE = {"blackwell": "nvfp4", "hopper": "fp8", "ada": "fp8", "ampere": "int4"}


def served(fmt: str) -> Served:
    return next(row for row in TABLE if fmt in row.formats)


def format_table() -> str:
    """README's table of formats, GPUs and engines, as Markdown."""
    lines = ["| format (recipe) | weights, inputs | GPUs | engines |", "|---|---|---|---|"]
    for row in TABLE:
        names = ", ".join(f"`{f}`" for f in row.formats)
        lines.append(f"| {names} | {row.weights} | {row.gpus_text()} | {row.engines_text} |")
    return "\n".join(lines)


def _plain(name: str) -> str:
    return re.sub(r"[\s_-]", "", name).lower()


def generation_of(target: str) -> str:
    """The GPU generation `--target` names: a generation, or a GPU of one (H200, B200, ...)."""
    want = _plain(target)
    if want in GENERATIONS:
        return want
    # the longest name that matches wins: L40S before L40, GB200 before B200
    found = sorted(
        ((len(_plain(g)), gen) for gen, gpus in GPUS.items() for g in gpus if want == _plain(g) or _plain(g) in want),
        reverse=True,
    )
    if not found:
        names = ", ".join(f"{gen} ({', '.join(GPUS[gen])})" for gen in GENERATIONS)
        raise ConfigError(f"--target {target!r}: not a GPU generation or a GPU eprt knows; give one of {names}")
    return found[0][1]


def runs_on(formats: list[str]) -> tuple[list[str], list[str]]:
    """(the generations that run every one of `formats` natively, those that run them all, some
    through weight-only kernels), oldest first."""
    rows = [served(f) for f in formats]
    native = [g for g in GENERATIONS if all(g in r.native for r in rows)]
    anyhow = [g for g in GENERATIONS if all(g in r.native or g in r.weight_only for r in rows)]
    return native, [g for g in anyhow if g not in native]


def engines_for(formats: list[str], layout: str) -> list[str]:
    """The engines that load an export of `formats` in `layout`."""
    return [e for e in ENGINES if all(e in served(f).engines.get(layout, ()) for f in formats)]


def check_target(formats: list[str], target: str, recipe: str) -> str | None:
    """Refuse a recipe whose formats `target`'s generation does not run; a warning where it runs
    them only through weight-only kernels; None where it runs them as calibrated."""
    gen = generation_of(target)
    native, weight_only = runs_on(formats)
    if gen in native:
        return None
    others = ", ".join(g.capitalize() for g in native) or "no single generation"
    if gen in weight_only:
        return (
            f"--target {target}: {gen.capitalize()} runs recipe {recipe} ({', '.join(formats)}) through weight-only "
            f"kernels only (bf16 inputs, not the inputs calibrated); it runs as calibrated on {others}"
        )
    picks = DEFAULT_RECIPE[gen]
    raise ConfigError(
        f"--target {target}: recipe {recipe} ({', '.join(formats)}) does not run on {gen.capitalize()} GPUs "
        f"(it runs on {others}); for {gen.capitalize()} give --recipe {picks}, or leave --recipe out and "
        f"--target picks it"
    )


def describe_gpus(formats: list[str]) -> str:
    """One line: which GPU generations serve an export of `formats`."""
    native, weight_only = runs_on(formats)
    text = ", ".join(f"{g.capitalize()} ({', '.join(GPUS[g][:3])})" for g in native) or "no single GPU generation"
    if weight_only:
        text += f"; {', '.join(g.capitalize() for g in weight_only)} through weight-only kernels"
    return text


def gpus_needed(weight_bytes: int, formats: list[str]) -> list[tuple[str, int, int]]:
    """(GPU, its GB, how many) of each generation that serves `formats` natively, oldest first: as
    many as hold `weight_bytes` of weights with a fifth of their memory left for the KV cache and
    activations, rounded up to a power of two (the tensor-parallel degrees engines take)."""
    native, _ = runs_on(formats)
    needs = []
    for g in native:
        gpu, gb = GPU_MEMORY_GB[g]
        count = max(1, math.ceil(weight_bytes / (0.8 * gb * 1e9)))
        needs.append((gpu, gb, 1 << (count - 1).bit_length()))
    return needs


def list_recipes() -> str:
    """Each shipped recipe, its formats and the GPUs that run it (`--list-recipes`)."""
    from eprt.quant.recipe import available, load_recipe

    rows = []
    for name in available():
        formats = load_recipe(name).formats
        rows.append(f"  {name:<34} {', '.join(formats):<16} {describe_gpus(formats)}")
    return "recipes (--recipe NAME; or a YAML file of your own):\n" + "\n".join(rows)
