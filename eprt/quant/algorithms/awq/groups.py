"""AWQ's balance groups: in one decoder layer, what makes a tensor and every module that reads it.

A group's scale s divides what makes the tensor and multiplies each reader's weight columns
(eprt.quant.algorithms.awq.folds), so every reader of the tensor must be in the group, quantized or not, or the
fold would change what the model computes. The groups by module kind:

- the attention input (`input_layernorm`'s output): GQA's q/k/v projections (and MiniMax-M3's
  indexer's q/k projections: GQAttention.input_readers); MLA's q_a_proj
  (q_proj without a q LoRA) and kv_a_proj_with_mqa, with DeepSeek-V3.2's indexer its wk and
  weights_proj, with Kimi's output gate its g_proj;
- the MoE input (`post_attention_layernorm`'s output): the router, every routed expert's gate/up
  (w13), the shared experts' gate/up, and Qwen3-Next's shared_expert_gate;
- a dense MLP's input (`post_attention_layernorm`'s output): its gate/up (or fused gate_up_proj);
- the attention's values (GQA): v_proj's rows / s, o_proj's columns * s repeated over the query
  heads of each kv head (attention and Qwen3-Next's output gate are linear in v);
- a gated MLP's activation silu(gate) * up, which is linear in up: up_proj's rows / s, down_proj's
  columns * s (dense MLPs, shared experts), and each routed expert's, with a scale of its own
  (w13's up rows, w2's columns).

Left out, by name (quantized as without AWQ): the hybrid layers' mixers (Gated DeltaNet, KDA), whose
input projections feed convolutions and gates this fold does not model; Kimi-K3's latent MoE, whose
routed experts read a projection of the norm's output, not the output itself; an activation other
than SwiGLU's (Kimi's SiTU bounds up through tanh: dividing up is not exact); GLM-4.5's v -> o (its
v_proj has a bias) and MLA's (v comes out of kv_b_proj beside the keys: not modeled yet).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eprt.models.attention import GQAttention
from eprt.models.layers import FusedGatedMLP, GatedMLP, RMSNorm, ZeroCenteredRMSNorm, silu_mul
from eprt.models.mla import MLAttention
from eprt.models.moe import Experts, GatedSharedExpertMoE, LatentMoE, MoE
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
    """(the balance groups of decoder layer `layer`, whose modules are `prefix` + their name in it;
    what is left out, each a module name and the reason)."""
    names = {id(m): prefix + n for n, m in layer.named_modules()}
    groups, left_out = [], []

    def norm_group(what: str, norm: nn.Module | None, readers: list[tuple[nn.Module, str]]) -> None:
        kind = norm_kind(norm)
        if kind is None:
            left_out.append(f"{names[id(readers[0][0])]}'s input ({what}): it is not an RMSNorm's output")
            return
        groups.append(Group(what, (names[id(norm)], kind), tuple((names[id(m)], k) for m, k in readers)))

    def activation_group(what: str, mlp: nn.Module) -> None:
        if isinstance(mlp, Experts):
            if mlp.act is not silu_mul:
                left_out.append(f"{names[id(mlp)]}'s down input: its activation is not SwiGLU's")
                return
            groups.append(Group(what, (names[id(mlp)], W13_UP_ROWS), ((names[id(mlp)], W2_COLUMNS),)))
        elif mlp.act is not silu_mul:
            left_out.append(f"{names[id(mlp.down_proj)]}'s input: its activation is not SwiGLU's")
        elif isinstance(mlp, FusedGatedMLP):
            left_out.append(f"{names[id(mlp.down_proj)]}'s input: gate and up are one projection (gate_up_proj)")
        else:
            groups.append(Group(what, (names[id(mlp.up_proj)], ROWS), ((names[id(mlp.down_proj)], COLUMNS),)))

    norm_in = getattr(layer, "input_layernorm", None)
    attn = getattr(layer, "self_attn", None)
    if isinstance(attn, GQAttention):
        norm_group("attention input", norm_in, [(attn.get_submodule(n), COLUMNS) for n in attn.input_readers()])
        if attn.v_proj.bias is not None:  # GLM-4.5's: its bias would need the fold too
            left_out.append(f"{names[id(attn.o_proj)]}'s input: v_proj has a bias")
        else:
            repeat = (attn.num_heads // attn.num_kv_heads, attn.head_dim)
            v, o = names[id(attn.v_proj)], names[id(attn.o_proj)]
            groups.append(Group("attention values", (v, ROWS), ((o, COLUMNS),), repeat))
    elif isinstance(attn, MLAttention):
        readers = [attn.q_a_proj if attn.q_lora else attn.q_proj, attn.kv_a_proj_with_mqa]
        if attn.indexer is not None:
            readers += [attn.indexer.wk, attn.indexer.weights_proj]
        if attn.g_proj is not None:  # Kimi's output gate
            readers.append(attn.g_proj)
        norm_group("attention input", norm_in, [(m, COLUMNS) for m in readers])
    else:
        mixer = attn if attn is not None else getattr(layer, "linear_attn", None)
        if mixer is not None:
            left_out.append(f"{names[id(mixer)]} ({type(mixer).__name__}): a hybrid mixer's input is not balanced")
    ffn = layer.ffn()
    norm_post = getattr(layer, "post_attention_layernorm", None)
    if isinstance(ffn, LatentMoE):
        left_out.append(f"{names[id(ffn)]}: the latent MoE's routed experts read a projection of the norm's output")
    elif isinstance(ffn, MoE):
        readers = [(ffn.gate, COLUMNS), (ffn.experts, W13_COLUMNS)]
        shared = ffn.shared_expert if isinstance(ffn, GatedSharedExpertMoE) else ffn.shared_experts
        if shared is not None:
            readers += [(shared.get_submodule(n), COLUMNS) for n in shared.input_readers()]
        if isinstance(ffn, GatedSharedExpertMoE):
            readers.append((ffn.shared_expert_gate, COLUMNS))
        norm_group("MoE input", norm_post, readers)
        activation_group("routed experts' activation", ffn.experts)
        if shared is not None:
            activation_group("shared experts' activation", shared)
    elif isinstance(ffn, (GatedMLP, FusedGatedMLP)):
        norm_group("MLP input", norm_post, [(ffn.get_submodule(n), COLUMNS) for n in ffn.input_readers()])
        activation_group("MLP activation", ffn)
    return groups, left_out


def norm_kind(norm: nn.Module | None) -> str | None:
    if isinstance(norm, ZeroCenteredRMSNorm):
        return CENTERED_NORM
    if isinstance(norm, RMSNorm):
        return NORM
    return None
