"""The checks of an export in GPT-OSS's release layout (`quant_method: mxfp4`,
eprt.hf.mxfp4_blocks_export), as vLLM's GPT-OSS class loads it: the release's quantization_config,
every routed-experts stack of config.json's model as `P_blocks` and `P_scales` (uint8, the shapes
its weight [E, out, in] gives them, no scale the E8M0 NaN), none of them matched by
modules_to_not_convert, and every other tensor the model's, in its shape. With the source, the
name set is exactly the source's (each encoded weight counted as the one weight it holds).
"""

from __future__ import annotations

import fnmatch
from pathlib import Path

from eprt.errors import EprtError
from eprt.families import parse_hf_config, reader_for
from eprt.hf.check_files import StoredTensor
from eprt.hf.check_names import decoded_names
from eprt.hf.source import HFSource
from eprt.layout import EXPERT_LEAVES, TensorSpec
from eprt.storage.hf_files import CONFIG
from eprt.storage.mxfp4_blocks import BLOCK, MXFP4_BLOCKS

PARTS = ("_blocks", "_scales")


def is_mxfp4_blocks(config: dict | None) -> bool:
    quant = config.get("quantization_config") if isinstance(config, dict) else None
    return isinstance(quant, dict) and quant.get("quant_method") == MXFP4_BLOCKS


def check_mxfp4_blocks(config: dict, tensors: dict[str, StoredTensor], source_dir, problems: list[str]) -> None:
    """Append a line for each way the export (its `config` and tensor headers) fails this layout."""
    kept = config["quantization_config"].get("modules_to_not_convert")
    if not isinstance(kept, list) or not all(isinstance(p, str) for p in kept):
        problems.append(f"{CONFIG}: quantization_config.modules_to_not_convert is {kept!r:.80}, not a list of names")
        kept = []
    specs = model_tensors(config)
    if specs is None:
        problems.append(f"{CONFIG}: eprt cannot lay out its model (model_type {config.get('model_type')!r})")
        return
    for name, spec in sorted(specs.items()):
        if spec.stacked:  # a stack of routed experts: its blocks and scales
            check_stack(name, spec, tensors, problems)
        elif name not in tensors:
            problems.append(f"{name}: missing; the model config.json describes has it")
        elif problem := spec.shape_problem(tensors[name].shape):
            problems.append(f"{name}: {problem}")
    for module in sorted({n.rsplit(".", 1)[0] for n, s in specs.items() if s.stacked}):
        if any(fnmatch.fnmatch(module, p) or module.startswith(f"{p}.") for p in kept):
            problems.append(
                f"{module}: matched by quantization_config.modules_to_not_convert, so the engines build it "
                "unquantized and cannot load its blocks; remove the entry"
            )
    expected = {n + p for n, s in specs.items() for p in (PARTS if s.stacked else ("",))}
    for name in sorted(set(tensors) - expected):
        problems.append(f"{name}: not a tensor of the model config.json describes; no engine loads it")
    if source_dir is not None:
        try:
            source = decoded_names(HFSource(str(source_dir)).tensors)
        except EprtError as e:
            problems.append(f"--source: {e}")
            return
        ours = decoded_names(tensors)
        for name in sorted(source - ours):
            problems.append(f"{name}: in the source {Path(source_dir)}, missing from the export")
        for name in sorted(ours - source):
            problems.append(f"{name}: in the export, not in the source {Path(source_dir)}")


def check_stack(name: str, spec: TensorSpec, tensors: dict, problems: list[str]) -> None:
    """The blocks and scales of the fused experts weight `name` (eprt's [E, out, in] `spec`)."""
    E, out_dim, in_dim = spec.shape
    want = {"_blocks": (E, out_dim, in_dim // BLOCK, BLOCK // 2), "_scales": (E, out_dim, in_dim // BLOCK)}
    for part, shape in want.items():
        t = tensors.get(name + part)
        if t is None:
            problems.append(
                f"{name + part}: missing; under quant_method {MXFP4_BLOCKS} the engines load every routed-experts "
                f"stack as {name}_blocks and {name}_scales"
            )
        elif t.dtype != "U8" or tuple(t.shape) != shape:
            problems.append(
                f"{name + part}: {t.dtype} {list(t.shape)}, not U8 {list(shape)} (weight {list(spec.shape)})"
            )
        elif part == "_scales" and t.bad_block_scales:
            problems.append(f"{name + part}: {t.bad_block_scales} scales are 255, E8M0's NaN")


def model_tensors(config: dict) -> dict[str, TensorSpec] | None:
    """Each tensor of the model `config` describes, as this layout names it -> its spec: a stack of
    routed-experts weights under its fused name (stacked), every other tensor as the source names it."""
    try:
        cfg = parse_hf_config(config)
        layout = reader_for(cfg.model_type, CONFIG).layout(cfg)
    except (EprtError, KeyError, TypeError, ValueError):
        return None
    out = {}
    for spec in layout.specs:
        weight = spec.stacked and spec.name.rsplit(".", 1)[1] in EXPERT_LEAVES
        if weight and spec.fused:
            out[spec.fused] = spec
        elif spec.stacked:
            out.update({spec.fused: spec.as_fused()} if spec.fused else dict.fromkeys(spec.sources, spec.as_piece()))
        else:
            out[spec.sources[0]] = spec
    return out
