"""The decoder-only causal LM the families share: embed, N decoder layers, final norm, head.

A decoder layer is a sequence of blocks, each a norm and a mixer (attention, linear attention, an
MLP, a MoE), joined by a residual rule; a family file chooses each layer's blocks, and a layer with
a residual rule of its own (attention residuals, several residual streams) overrides `enter` and
`leave`. So an attention-only, a MoE-only or a Mamba layer holds exactly its parts. Every block but
the last is dense; the last may be routed (a `MoE`): the calibration engine runs a layer as "the
dense blocks, one sequence at a time, then the routed block over the step's tokens of every rank"
(`before_routed`, `after_routed`), knowing nothing else of it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from eprt.config import ModelConfig
from eprt.models.balance import Balance, pre_norm_groups
from eprt.models.layers import Linear, RMSNorm, linear
from eprt.models.moe import MoE
from eprt.models.rope import Rotary


class Embedding(nn.Module):
    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight)


class DecoderParts(nn.Module):
    """The decoder's own modules a multi-token-prediction layer reads, under their names in the
    decoder: the embedding (`embed_tokens`) and, where it reads it, the final norm (`norm`)."""

    def __init__(self, c: ModelConfig, final_norm: bool = False):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        if final_norm:
            self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def held_by(self, mtp: nn.Module) -> None:
        """Held by MTP layer `mtp` as its `decoder_parts`, not registered: no part of the layer a
        calibration quantizes; the loader fills them from the decoder's tensors
        (eprt.loading.loader.mtp_meta)."""
        object.__setattr__(mtp, "decoder_parts", self)


# What a residual rule keeps from a block's entry to its leaving: the stream (a rule of several
# streams: their mixing weights too); nothing but the rule looks into it.
Carry = Any


@dataclass(frozen=True)
class Block:
    """One block of a decoder layer, by the names its modules (hence its tensors) carry in the
    layer: the mixer `mixer` reads the output of the norm `norm`."""

    norm: str
    mixer: str
    rotary: bool = False  # the mixer takes the rotary tables (cos, sin) after its input
    carries: bool = False  # the mixer takes the context's `carried` (keyword `carried`)


@dataclass
class LayerContext:
    """What a layer reads of its sequences besides the hidden states: the rotary tables (None where
    no layer rotates), the attention residuals' snapshots so far (`AttentionResidualLayer`), to
    which a layer may add, and what earlier layers left for the layers after them (`carried`, by
    name: each entry the latest a layer left, which a later layer may replace; index sharing's
    top-k, eprt.models.mla). Every tensor in it holds the same sequences as the hidden states."""

    cos: torch.Tensor | None = None
    sin: torch.Tensor | None = None
    snapshots: list[torch.Tensor] = field(default_factory=list)
    carried: dict[str, torch.Tensor] = field(default_factory=dict)


class DecoderLayer(nn.Module):
    """`blocks` in order, each (Block, its norm, its mixer), under the plain pre-norm residual rule:
    x + mixer(norm(x)), block after block."""

    def __init__(self, *blocks: tuple[Block, nn.Module, nn.Module]):
        super().__init__()
        for block, norm, mixer in blocks:
            self.add_module(block.norm, norm)
            self.add_module(block.mixer, mixer)
        self.blocks = tuple(block for block, _, _ in blocks)
        routed_early = [b.mixer for b in self.blocks[:-1] if isinstance(getattr(self, b.mixer), MoE)]
        assert not routed_early, f"a routed block comes last in its layer, not {routed_early}"

    def forward(self, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        for k in range(len(self.blocks)):
            x = self.run_block(k, x, ctx)
        return x

    def run_block(self, k: int, x: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        carry, m = self.block_input(k, x, ctx)
        block = self.blocks[k]
        mixer = getattr(self, block.mixer)
        args = (ctx.cos, ctx.sin) if block.rotary else ()
        y = mixer(m, *args, carried=ctx.carried) if block.carries else mixer(m, *args)
        return self.leave(k, carry, y, ctx)

    def block_input(self, k: int, x: torch.Tensor, ctx: LayerContext) -> tuple[Carry, torch.Tensor]:
        """(what block k's output joins, its mixer's input) from the stream `x` before it."""
        carry, h = self.enter(k, x, ctx)
        return carry, getattr(self, self.blocks[k].norm)(h)

    # The residual rule: how block k reads the stream and how its mixer's output joins it.

    def enter(self, k: int, x: torch.Tensor, ctx: LayerContext) -> tuple[Carry, torch.Tensor]:
        """(what `leave` joins block k's output to, what its norm reads): the stream, twice."""
        return x, x

    def leave(self, k: int, carry: Carry, y: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """The stream after block k, whose mixer gave `y`: the sum."""
        return carry + y

    def snapshots(self, x: torch.Tensor) -> list[torch.Tensor]:
        """What the layer files into `ctx.snapshots` as it runs, from its input `x` alone (of any
        batch of sequences: the engine, which runs a layer one sequence at a time, files them for
        all its sequences at once): nothing."""
        return []

    def balance_groups(self) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): each block's norm, with the mixer that reads it."""
        return [g for b in self.blocks for g in pre_norm_groups(getattr(self, b.norm), getattr(self, b.mixer))]

    # The calibration engine's view: the dense blocks, then at most one routed block.

    @property
    def routed(self) -> MoE | None:
        """The routed block's mixer: the last block's, where it is a MoE."""
        mixer = getattr(self, self.blocks[-1].mixer)
        return mixer if isinstance(mixer, MoE) else None

    def before_routed(self, x: torch.Tensor, ctx: LayerContext) -> tuple[Carry, torch.Tensor]:
        """Every dense block, then the routed block's entry: (what its output joins, its MoE's input)."""
        last = len(self.blocks) - 1
        for k in range(last):
            x = self.run_block(k, x, ctx)
        return self.block_input(last, x, ctx)

    def route(self, m_TD: torch.Tensor, ctx: LayerContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routed block's `route` of its input rows `m_TD` (one sequence's, in `ctx`): a layer
        whose router reads more of the sequence than its input (token ids) passes it on."""
        return self.routed.route(m_TD)

    def after_routed(self, carry: Carry, y: torch.Tensor, ctx: LayerContext) -> torch.Tensor:
        """The layer's output from `before_routed`'s carry and the routed block's output `y`."""
        return self.leave(len(self.blocks) - 1, carry, y, ctx)


def attention_then_mlp(
    c: ModelConfig,
    mixer: nn.Module,
    mlp: nn.Module,
    *,
    mixer_name: str = "self_attn",
    mlp_name: str = "mlp",
    rotary: bool = True,
    carries: bool = False,
    norm: type[nn.Module] = RMSNorm,
) -> tuple[tuple[Block, nn.Module, nn.Module], ...]:
    """The two blocks of the usual layer: `mixer` behind `input_layernorm`, then `mlp` behind
    `post_attention_layernorm`."""
    D, eps = c.hidden_size, c.rms_norm_eps
    return (
        (Block("input_layernorm", mixer_name, rotary, carries), norm(D, eps), mixer),
        (Block("post_attention_layernorm", mlp_name), norm(D, eps), mlp),
    )


class Decoder(nn.Module):
    """input_ids [B, T] -> final hidden states [B, T, D]."""

    def __init__(self, c: ModelConfig, layers: list[DecoderLayer]):
        super().__init__()
        self.embed_tokens = Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        rope = c.rope
        self.rotary = None if rope is None else Rotary(c.rotary_dim, rope.theta, rope.yarn, c.max_position_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        ctx = self.context(input_ids.shape[1], x.dtype, x.device, [], self.first_carried(input_ids))
        for layer in self.layers:
            x = layer(x, ctx)
        return self.final(x, ctx.snapshots)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The hidden states entering layer 0."""
        return self.embed_tokens(input_ids)

    def first_carried(self, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
        """What the layers read of the sequences `input_ids` [B, T] besides their embedding, in the
        context's `carried` from layer 0 on (DeepSeek-V4's hash routing reads the token ids): nothing."""
        return {}

    def final(self, x: torch.Tensor, snapshots: list[torch.Tensor]) -> torch.Tensor:
        """The decoder's output from the last layer's hidden states (and the snapshots): what the
        head reads. A layer-by-layer run calls it after its last layer."""
        return self.norm(x)

    def context(
        self,
        seq_len: int,
        dtype: torch.dtype,
        device,
        snapshots: list[torch.Tensor],
        carried: dict[str, torch.Tensor] | None = None,
    ) -> LayerContext:
        """What every layer reads of sequences of `seq_len` tokens whose snapshots so far are
        `snapshots` and to which earlier layers left `carried` (none: nothing yet)."""
        cos, sin = (None, None) if self.rotary is None else self.rotary(seq_len, dtype, device)
        return LayerContext(cos, sin, snapshots, {} if carried is None else carried)


class CausalLM(nn.Module):
    """`model(input_ids)` ([B, T] int64, causal, no padding) -> logits [B, T, vocab]."""

    # The name the checkpoint gives the decoder, the prefix of its tensors (Nemotron-H's `backbone`).
    decoder_name = "model"

    def __init__(self, c: ModelConfig, layers: list[nn.Module], decoder: type[nn.Module] = Decoder):
        super().__init__()
        self.config = c
        self.add_module(self.decoder_name, decoder(c, layers))
        # Tied embeddings: the head reads model.embed_tokens.weight and has no tensor of its own.
        self.lm_head = None if c.tie_word_embeddings else Linear(c.hidden_size, c.vocab_size)

    @property
    def model(self) -> nn.Module:
        """The decoder, whatever the checkpoint names it."""
        if self.decoder_name not in self._modules:  # not yet built: no attribute, as nn.Module says
            raise AttributeError(f"{type(self).__name__} has no decoder yet")
        return self._modules[self.decoder_name]

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.logits(self.model(input_ids))

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """The head over the decoder's output."""
        head = self.model.embed_tokens if self.lm_head is None else self.lm_head
        return linear(h, head.weight)

    def decoder(self) -> tuple[str, nn.Module]:
        """(the prefix of its tensor names, the decoder): what a layer-by-layer run walks."""
        return f"{self.decoder_name}.", self.model

    def moe_blocks(self) -> list[tuple[int, MoE]]:
        return [(i, layer.routed) for i, layer in enumerate(self.model.layers) if layer.routed is not None]

    def set_dispatcher(self, make_dispatcher: Callable[[int, MoE], Callable]) -> None:
        """Install `make_dispatcher(layer_index, block)` as the dispatcher of every MoE block."""
        for i, block in self.moe_blocks():
            block.dispatcher = make_dispatcher(i, block)
