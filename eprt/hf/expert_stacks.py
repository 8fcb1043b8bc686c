"""Stacks of routed experts as a checkpoint eprt does not model holds them, by name and shape:
`P.experts.gate_up_proj` (each expert's gate, then its up, or the two interleaved), `gate_proj`,
`up_proj`, `down_proj` (with or without a `.weight` leaf) and their biases (`P.experts.down_proj_bias`),
stored [E, out, in] as transformers 5 holds most, or [E, in, out] as its GPT-OSS and Llama-4 do.
The model-free export (eprt.hf.streaming.selection) and the check of its output against the source
(eprt.hf.check_unmodeled) read them alike."""

from __future__ import annotations

import re

STACKED = re.compile(r"(?P<experts>.+\.experts)\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)(\.weight)?")
STACKED_BIAS = re.compile(r"(?P<experts>.+\.experts)\.(?P<proj>gate_up_proj|gate_proj|up_proj|down_proj)_bias")


def hidden_size(config: dict) -> int | None:
    """The hidden size of a checkpoint's language model (a VLM's `text_config`), as config.json says."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    hidden = text.get("hidden_size")
    return hidden if isinstance(hidden, int) else None


def expert_entries(name: str, shape: tuple[int, ...], hidden: int | None) -> dict[str, tuple[int, ...]]:
    """A stack of experts, or its biases, as a quantized export writes it: each expert's projection's
    tensor (`P.experts.{e}.gate_proj.weight` [out, in], `.bias` [out]) by name and shape; {} for any
    other tensor, or a stack no order fits. Where both orders fit (a square stack) their shapes agree."""
    bias = STACKED_BIAS.fullmatch(name)
    m = bias or STACKED.fullmatch(name)
    if m is None or len(shape) != (2 if bias else 3):
        return {}
    pieces = pieces_of(m["proj"])
    if bias:
        h = shape[1] // len(pieces)
        return {f"{m['experts']}.{e}.{p}.bias": (h,) for e in range(shape[0]) for p in pieces}
    fits = orders(m["proj"], shape, hidden) if hidden is not None else set()
    if not fits:
        return {}
    _, a, b = shape
    out_dim, in_dim = (b, a) if min(fits) else (a, b)
    h = out_dim // len(pieces)
    return {f"{m['experts']}.{e}.{p}.weight": (h, in_dim) for e in range(shape[0]) for p in pieces}


def pieces_of(proj: str) -> tuple[str, ...]:
    """The per-expert projections a stacked projection holds end to end along its outputs."""
    return ("gate_proj", "up_proj") if proj == "gate_up_proj" else (proj,)


def orders(proj: str, shape: tuple[int, ...], hidden: int) -> set[bool]:
    """Which orders a stack of projection `proj` of `shape` fits (False: [E, out, in]; True: [E, in, out]):
    gate and up read the hidden state, down writes it; a fused gate_up's outputs come in pairs."""
    _, a, b = shape
    fits = set()
    for transposed, (out_dim, in_dim) in ((False, (a, b)), (True, (b, a))):
        if (in_dim if proj != "down_proj" else out_dim) == hidden and out_dim % len(pieces_of(proj)) == 0:
            fits.add(transposed)
    return fits
