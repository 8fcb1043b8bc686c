"""Nemotron-H's multi-token-prediction step (Super, Ultra), as vLLM's NemotronHMTP
(model_executor/models/nemotron_h_mtp.py) builds and runs it; transformers has none.

The step is the layers `mtp.layers.0 .. P-1`, one per kind of `mtp_layers_block_type` (the releases:
attention, then MoE), each a norm and a mixer of the decoder's kinds under the plain pre-norm
residual rule. The first joins the token `shift` ahead and the decoder's output,
`eh_proj(cat(enorm(embed(token[t + shift])), hnorm(h[t])))`, the embedding first; `h` is what the
decoder hands the head, after its final norm (vLLM's NemotronHModel returns `norm_f`'s output, and
its speculative decoding passes that on). The last layer's output goes through `final_layernorm`
to the model's head. The embedding, the final norm and the head are the model's: the step holds
the embedding and final norm apart from its own modules (`decoder_parts`, named as in the decoder,
which the loader fills from the decoder's tensors), and never reads the head.
"""

from __future__ import annotations

import torch
from torch import nn

from eprt.config import ModelConfig
from eprt.families.nemotron_h.layout import DECODER
from eprt.families.nemotron_h.model import mixer
from eprt.models.decoder import Block, DecoderLayer, DecoderParts
from eprt.models.layers import Linear, RMSNorm


def step_prefix(decoder: str, c: ModelConfig, k: int) -> str:
    """The step's tensors are `mtp.layers.N` beside the decoder (`backbone.`): under the decoder's
    parent, `mtp.` (`language_model.mtp.` in the Omni)."""
    return decoder.removesuffix(f"{DECODER}.") + "mtp."


class NemotronHMTP(DecoderLayer):
    """The step as one decoder layer whose blocks are its layers' (norm, mixer), named by their
    paths (`layers.0.norm`, `layers.0.mixer`, ...) so that its tensors carry the release's names
    after its prefix (`mtp.`); the first layer also holds enorm, hnorm and eh_proj, the last
    final_layernorm. The decoder's parts it reads are held apart (`decoder_parts`): they are no
    part of the layer a calibration quantizes."""

    def __init__(self, c: ModelConfig, expert_range: tuple[int, int] | None = None):
        D, eps, kinds = c.hidden_size, c.rms_norm_eps, c.own.mtp_layer_kinds
        super().__init__(
            *(
                (Block(f"layers.{k}.norm", f"layers.{k}.mixer"), RMSNorm(D, eps), mixer(c, kind, expert_range))
                for k, kind in enumerate(kinds)
            )
        )
        first, last = self.get_submodule("layers.0"), self.get_submodule(f"layers.{len(kinds) - 1}")
        first.enorm, first.hnorm, first.eh_proj = RMSNorm(D, eps), RMSNorm(D, eps), Linear(2 * D, D)
        last.final_layernorm = RMSNorm(D, eps)
        DecoderParts(c, final_norm=True).held_by(self)

    def add_module(self, name: str, module: nn.Module | None) -> None:
        """DecoderLayer registers each block's norm and mixer by its name: here a path, whose
        parents are made as the path asks (`layers.0` for `layers.0.mixer`)."""
        parent = self
        *parents, leaf = name.split(".")
        for part in parents:
            if part not in parent._modules:
                nn.Module.add_module(parent, part, nn.Module())
            parent = parent._modules[part]
        nn.Module.add_module(parent, leaf, module)

    def __getattr__(self, name: str):
        # DecoderLayer reads a block's norm and mixer as its attributes named by the block: a path here
        return self.get_submodule(name) if "." in name else super().__getattr__(name)

    def mtp_input(self, input_ids: torch.Tensor, hidden: torch.Tensor, shift: int = 1) -> torch.Tensor:
        """The first layer's input for sequences `input_ids` [B, T] whose last decoder layer gave
        `hidden` [B, T, D] (before the final norm): at position t, eh_proj(cat(enorm(embed(token[t +
        shift])), hnorm(norm_f(hidden[t])))). A calibration sample has no token past its end: the
        embedding there is zero, as vLLM zeroes one it has none for."""
        shared, first = self.decoder_parts, self.get_submodule("layers.0")
        emb = shared.embed_tokens(input_ids[:, shift:])
        emb = torch.cat([emb, emb.new_zeros(emb.shape[0], input_ids.shape[1] - emb.shape[1], emb.shape[2])], dim=1)
        return first.eh_proj(torch.cat([first.enorm(emb), first.hnorm(shared.norm(hidden))], dim=-1))

    def mtp_output(self, x: torch.Tensor) -> torch.Tensor:
        """What the step hands the model's head from its last layer's output `x`."""
        return self.get_submodule(f"layers.{len(self.blocks) - 1}").final_layernorm(x)
