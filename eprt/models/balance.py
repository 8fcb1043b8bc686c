"""AWQ's balance groups as the model declares them, as it declares its taps (eprt.models.taps).

A balance group is one tensor inside a layer and every module that reads it: a scale s per channel
divides what makes the tensor and multiplies each reader's weight columns, so the layer computes
the same in exact arithmetic (eprt.quant.algorithms.awq). Every reader must be in the group, or the
fold would change what the model computes; only the module that builds the tensor's path knows
them all, so each module kind declares its own groups:

- a mixer reading a norm's output (`balance_groups(norm)`): GQAttention, MLAttention, GatedMLP and
  the MoE blocks (eprt.models.attention, mla, layers, moe);
- a gated MLP's activation, linear in up (`activation_group(what)`): GatedMLP and Experts;
- a decoder layer (`balance_groups()`): its norms paired with the mixers that read them
  (`pre_norm_groups`).

What cannot be balanced exactly is declared `Unbalanced`, with the reason, and quantized as without
AWQ; a mixer that declares nothing (a hybrid layer's linear attention) is left out by itself.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class BalanceGroup:
    what: str  # for the log: attention input, MoE input, MLP input, MLP activation, experts' activation
    # What makes the tensor, its part divided by s: a norm's weight, a Linear's rows (a gated MLP's
    # up_proj, v_proj), the routed experts' up rows (each expert its own s).
    source: nn.Module
    # Every module that reads the tensor, its columns multiplied by s: Linears, a router, the routed
    # experts (their gate/up, or their down where they are the source too). The first one's input
    # is the tensor.
    readers: tuple[nn.Module, ...]
    # v -> o: (query heads per kv head, head dim): o's columns are v's rows, each kv head's repeated
    # over the query heads that read it, so o's scale is v's repeated
    repeat: tuple[int, int] | None = None


@dataclass(frozen=True)
class Unbalanced:
    module: nn.Module
    why: str  # for the log: "AWQ leaves out <module> (<why>)"


Balance = BalanceGroup | Unbalanced


def pre_norm_groups(norm: nn.Module, mixer: nn.Module) -> list[Balance]:
    """The groups of `mixer`, which reads `norm`'s output, and those inside it."""
    declare = getattr(mixer, "balance_groups", None)
    if declare is None:
        return [Unbalanced(mixer, f"{type(mixer).__name__} declares no balance groups")]
    return declare(norm)
