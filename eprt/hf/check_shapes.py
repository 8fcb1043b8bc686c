"""The shape check of a quantized export: every tensor has the shape its model's config.json gives it.

An engine builds each module from config.json and copies the checkpoint's tensors into it, so a
weight and its block scales one block short of the config agree with each other and still fail
to load (or load into the wrong slots). The expected shape of each tensor comes from the family
layout (eprt.families, eprt.layout): an unquantized tensor has its source shape, and a quantized
Linear of weight [out, in] stores its format's companions (`companions(out, in)`: ModelOpt's or
compressed-tensors'). One dict lookup per tensor.

When the weight of a quantized Linear has the config's shape, its scales are checked against the
weight by the format's own checks; only a weight that differs from the config is reported here,
with each of its companions that differs too.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable

from eprt.errors import EprtError
from eprt.families import parse_hf_config, reader_for
from eprt.layout import Layout, TensorSpec
from eprt.storage.hf_files import CONFIG

Companions = Callable[[int, int], dict[str, tuple[object, tuple[int, ...]]]]


def source_specs(config: dict | None) -> dict[str, TensorSpec] | None:
    """Each Hugging Face tensor name the family layout of `config` knows -> its spec with the
    shape of that one tensor (a routed expert's projection, a fused experts tensor); None when
    eprt cannot lay the config out."""
    try:
        cfg = parse_hf_config(config or {})
        layout = reader_for(cfg.model_type, CONFIG).layout(cfg)
    except (EprtError, KeyError, TypeError, ValueError):
        return None
    return _by_source(layout)


def _by_source(layout: Layout) -> dict[str, TensorSpec]:
    out = {}
    for spec in (*layout.specs, *layout.mtp):
        if spec.stacked:
            # one expert's projection, as Linear-shaped as the per-expert form stores it (whatever the fused form's order)
            one = replace(spec, shape=spec.source_shape(), stacked=False, per_row=1, transposed=False, interleaved=1)
            out.update(dict.fromkeys(spec.sources, one))
            if spec.fused:
                out[spec.fused] = replace(
                    spec,
                    shape=spec.fused_shape(),
                    sources=(spec.fused,),
                    stacked=False,
                    per_row=1,
                    transposed=False,
                    interleaved=1,
                )
        else:  # a tensor spelled two ways (Kimi-Linear's dense MLP) has one shape under either name
            out.update(dict.fromkeys((*spec.sources, *([spec.alias] if spec.alias else [])), spec))
    return out


def check_shapes(
    tensors: dict, companions: dict[str, Companions], specs: dict[str, TensorSpec], where: str, problems: list[str]
) -> None:
    """Append a line for every tensor whose shape is not the one `specs` (from the config.json
    named `where`) gives it. `tensors`: name -> header with `.shape`; `companions`: each quantized
    module -> its format's tensors for a weight [out, in]."""
    for name, t in tensors.items():
        module = name.rpartition(".")[0]
        spec = specs.get(name)
        if module in companions or spec is None:
            continue
        problem = spec.shape_problem(t.shape)
        if problem:
            problems.append(f"{name}: {problem.replace('config.json', where)}")
    for module, tensors_of in sorted(companions.items()):
        spec = specs.get(f"{module}.weight")
        if spec is None or len(spec.source_shape()) != 2:
            continue  # a module no layout knows: the name check speaks of it
        out_dim, in_dim = spec.source_shape()
        want = tensors_of(out_dim, in_dim)
        weight = next(iter(want))  # weight, or weight_packed
        have = tensors.get(f"{module}.{weight}")
        if have is None or tuple(have.shape) == want[weight][1]:
            continue
        for leaf, (_, shape) in want.items():
            t = tensors.get(f"{module}.{leaf}")
            if t is not None and tuple(t.shape) != shape:
                problems.append(
                    f"{module}.{leaf}: shape {list(t.shape)}, but {where} makes {module} a Linear of "
                    f"[{out_dim}, {in_dim}], which this format stores as {list(shape)}; the engines "
                    "build the module from the config and cannot load it"
                )
