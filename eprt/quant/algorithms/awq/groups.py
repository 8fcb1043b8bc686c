"""AWQ's balance groups: in one decoder layer, what makes a tensor and every module that reads it.

A group's scale s divides what makes the tensor and multiplies each reader's weight columns
(eprt.quant.algorithms.awq.folds), so every reader of the tensor must be in the group, quantized or
not, or the fold would change what the model computes. The model declares its groups
(eprt.models.balance: each module kind its own, a decoder layer its norms with the mixers that read
them); this module names their modules and picks each one's fold by the tensor it changes:

- what makes the tensor: an RMSNorm's weight (a zero-centered one's 1 + w), a Linear's rows, the
  routed experts' up rows (w13's second half, each expert its own s);
- a reader: a Linear's or router's columns, the routed experts' gate/up columns (w13), or their
  down columns (w2) where they also make the tensor (their activation).

The groups the models declare today: the attention input (GQA's q/k/v, with MiniMax-M3's
block-sparse indexer its q/k projections; MLA's q_a_proj or q_proj and kv_a_proj_with_mqa,
DeepSeek-V3.2's indexer wk and weights_proj, Kimi's g_proj); the MoE input (router, routed experts'
gate/up, shared experts' gate/up or fused gate_up_proj, Qwen3-Next's shared_expert_gate); a dense
MLP's input; GQA's values (v -> o, o's scale v's repeated over the query heads); a SwiGLU
activation (dense MLPs, shared experts, each routed expert). Declared unbalanced (quantized as
without AWQ): the hybrid layers' mixers (Gated DeltaNet, KDA declare no groups), Kimi-K3's latent
MoE, routed experts with biases or without a gate (GPT-OSS's, Nemotron-H's), an activation other than SwiGLU's, the activation behind a fused gate_up_proj, GLM-4.5's v -> o (v_proj has a bias), MLA's v -> o.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eprt.models.balance import Unbalanced
from eprt.models.layers import Linear, RMSNorm, ZeroCenteredRMSNorm
from eprt.models.moe import Experts
from eprt.quant.algorithms.awq.folds import CENTERED_NORM, COLUMNS, NORM, ROWS, W2_COLUMNS, W13_COLUMNS, W13_UP_ROWS


@dataclass(frozen=True)
class Group:
    what: str  # for the log: attention input, MoE input, MLP input, MLP activation, experts' activation
    divided: tuple[str, str]  # (full module name, fold kind): what makes the tensor, divided by s
    readers: tuple[tuple[str, str], ...]  # (full module name, fold kind): columns * s; the first's input is the tensor
    # v -> o: (query heads per kv head, head dim): o's columns are v's rows, each kv head's repeated
    # over the query heads that read it, so o's scale is v's repeated
    repeat: tuple[int, int] | None = None

    def reader_scales(self, s: torch.Tensor) -> torch.Tensor:
        """The readers' scales of the divided tensor's `s` [..., C]: the same, or v's repeated for o."""
        if self.repeat is None:
            return s
        heads, head_dim = self.repeat
        lead = s.shape[:-1]
        return s.view(*lead, -1, 1, head_dim).expand(*lead, -1, heads, head_dim).reshape(*lead, -1)

    @property
    def per_expert(self) -> bool:
        """The routed experts' activations: each expert a scale of its own."""
        return self.readers[0][1] == W2_COLUMNS


def layer_groups(layer: nn.Module, prefix: str) -> tuple[list[Group], list[str]]:
    """(the balance groups decoder layer `layer` declares, whose modules are `prefix` + their name
    in it; what is left out, each a module name and the reason)."""
    names = {id(m): prefix + n for n, m in layer.named_modules()}
    declare = getattr(layer, "balance_groups", None)
    if declare is None:
        return [], [f"{prefix.rstrip('.')} ({type(layer).__name__} declares no balance groups)"]
    groups, left_out = [], []
    for g in declare():
        if isinstance(g, Unbalanced):
            left_out.append(f"{names[id(g.module)]} ({g.why})")
            continue
        divided = source_fold(g.source)
        if divided is None:
            left_out.append(f"{names[id(g.readers[0])]}'s input ({g.what}): it is not an RMSNorm's output")
            continue
        readers = tuple((names[id(m)], reader_fold(m, g.source)) for m in g.readers)
        groups.append(Group(g.what, (names[id(g.source)], divided), readers, g.repeat))
    return groups, left_out


def source_fold(m: nn.Module) -> str | None:
    """The fold of what makes a group's tensor: divided by s (None: a module AWQ cannot fold)."""
    if isinstance(m, ZeroCenteredRMSNorm):
        return CENTERED_NORM
    if isinstance(m, RMSNorm):
        return NORM
    if isinstance(m, Experts):
        return W13_UP_ROWS
    return ROWS if isinstance(m, Linear) else None


def reader_fold(m: nn.Module, source: nn.Module) -> str:
    """The fold of a reader of the tensor: its columns multiplied by s."""
    if isinstance(m, Experts):
        return W2_COLUMNS if m is source else W13_COLUMNS
    return COLUMNS
