"""The check of an export of a model eprt does not model (eprt-export's model-free path): no family
layout predicts its names and shapes, so the check holds it to what every export obeys (each
quantized Linear's companions, of the shapes its format gives its weight; no tensor an engine
does not load), and, with the source directory, to the source's own names and shapes: each
tensor carried as the source holds it, each quantized Linear's companions shaped from the
source's weight, a stack of experts carried whole or written expert by expert (`split_stacks`). It
says so, rather than passing the export as checked against a model."""

from __future__ import annotations

import os

from eprt.families import read_hf_config, supported_model_types
from eprt.hf.expert_stacks import expert_entries, hidden_size
from eprt.hf.source import HFSource
from eprt.layout import TensorSpec
from eprt.storage.encodings import source_quantization
from eprt.storage.hf_files import CONFIG


def not_modeled(config: dict | None) -> str | None:
    """The line saying how an export of `config` is checked where eprt does not model its family, else None."""
    model_type = (config or {}).get("model_type")
    if model_type in supported_model_types():
        return None
    return (
        f"model_type {model_type!r} is not a family eprt models: checked by the names and shapes of its tensors "
        "alone (each quantized Linear's tensors against its format; with --source, every name and shape against "
        "the source's), not against a model's layout"
    )


def split_stacks(shapes: dict[str, tuple[int, ...]], config: dict) -> dict[str, dict[str, tuple[int, ...]]]:
    """Each stack of experts of a source (and each stack's biases) -> its experts' tensors as a
    quantized export writes them, by name and shape (eprt.hf.expert_stacks.expert_entries)."""
    hidden = hidden_size(config)
    entries = {n: expert_entries(n, tuple(shape), hidden) for n, shape in shapes.items()}
    return {n: e for n, e in entries.items() if e}


def source_shape_specs(source_dir: str) -> dict[str, TensorSpec] | None:
    """Each tensor of an unquantized source directory -> a spec of its shape, or None where the
    source stores weights encoded (their decoded shapes are the export's concern, not this check's)."""
    try:
        if source_quantization(read_hf_config(source_dir), os.path.join(source_dir, CONFIG)) is not None:
            return None
        src = HFSource(source_dir)
    except Exception:  # said by the name check's --source line
        return None
    try:
        shapes = {n: tuple(info.shape) for n, (_, info) in src.tensors.items()}
    finally:
        src.close()
    experts = {n: shape for e in split_stacks(shapes, read_hf_config(source_dir)).values() for n, shape in e.items()}
    return {n: TensorSpec(n, shape, (n,)) for n, shape in {**shapes, **experts}.items()}
