"""Which tensors the rotations change, and how: read off the model's structure.

The residual-stream rotation (QuaRot's and SpinQuant's R1) multiplies the hidden state by an
orthogonal Q of width D everywhere: h' = h Q. An RMSNorm commutes with it once its weight is
folded into what reads it (‖hQ‖ = ‖h‖, so rmsnorm(hQ) = rmsnorm(h) Q when the weight is 1), so:

- the embeddings' rows are rotated: E Q;
- every norm of the stream (each layer's input and post-attention norms, the final norm, the MTP
  layers' enorm, hnorm and head norm) becomes the identity (1, or 0 where the weight is stored
  centred on 0 and scales by 1 + w: Qwen3-Next's), its weight folded into each of its readers;
- every reader of a norm's output (attention and mixer input projections, MLA's q_a/kv_a, the
  DSA indexer's wk and weights_proj, routers, every routed and shared expert's gate/up, the
  shared-expert gate, dense MLPs, a latent MoE's down projection into its latent, Mamba's in_proj,
  the head, MTP's eh_proj) reads W diag(g) Q over its input;
- every writer into the stream (o_proj, a mixer's out_proj, every down projection, a latent MoE's
  up projection out of its latent, eh_proj)
  writes Qᵀ W: its rows rotated, and its bias with them.

The per-head rotation (R2) rotates each head's values by an orthogonal H of the head width and
o_proj's columns of that head by the same H, where the attention is linear in each head's value:
GQA without an output gate (v_proj's rows), MLA without one (kv_b_proj's value rows). Where a
gate multiplies the attention output channel by channel (Qwen3-Next's gated attention, Kimi's
MLA output gate) or a norm sits between the values and o_proj (Gated DeltaNet, KDA, Mamba-2's gated
group norm), H does not
commute with it: those values stay unrotated, said in `left_out`.

What cannot be rotated exactly is refused, naming it: tied embeddings (the head would need the
final norm folded into the embedding table), a module of the stream this plan does not know
(attention residuals) or a residual rule other than the plain sum (each layer is read
block by block: a norm, then the mixer that reads it and writes the stream), a tensor carried through the export untouched that reads or
writes the stream (a vision tower's projector).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from eprt.errors import ConfigError
from eprt.models.attention import GQAttention
from eprt.models.decoder import DecoderLayer
from eprt.models.gated_delta import GatedDeltaNet
from eprt.models.kda import KimiDeltaAttention
from eprt.models.layers import FusedGatedMLP, GatedMLP, Linear, RMSNorm, UngatedMLP, ZeroCenteredRMSNorm
from eprt.models.mamba2 import Mamba2Mixer
from eprt.models.mla import MLAttention
from eprt.models.moe import GatedSharedExpertMoE, LatentMoE, MoE

R1_SEED, R2_SEED = 0, 1  # the residual rotation's and the per-head rotation's draws (hadamard.random_hadamard)
DECODER_PARTS = {"embed_tokens", "layers", "norm", "rotary"}
MLPS = (GatedMLP, FusedGatedMLP, UngatedMLP)


@dataclass(frozen=True)
class Norm:
    name: str  # the norm's weight tensor
    centered: bool  # stored centred on 0: it scales by 1 + w


@dataclass(frozen=True)
class Residual:
    """The residual rotation over `axis` (-1: a weight's input columns, a vector; -2: a weight's
    output rows); with `norms`, the axis is len(norms) runs of D, each scaled by its norm first."""

    axis: int
    norms: tuple[Norm, ...] = ()


@dataclass(frozen=True)
class PerHead:
    """The per-head rotation over `axis`: in each run of `period` entries, [offset, offset + width)."""

    axis: int
    period: int
    offset: int
    width: int


@dataclass(frozen=True)
class Identity:
    """A norm whose weight was folded into its readers: `value` everywhere (1, or 0 centred)."""

    value: float


Step = Residual | PerHead | Identity


@dataclass
class RotationPlan:
    """Every tensor the rotations change -> its steps, in order; what R2 leaves unrotated, and why."""

    width: int  # D
    steps: dict[str, tuple[Step, ...]]
    left_out: list[str]
    mtp: tuple[str, ...]  # the multi-token-prediction layers' prefixes


def rotation_plan(model: nn.Module) -> RotationPlan:
    """The plan of `model` (built on the meta device) and of its config's multi-token-prediction
    layers, which sit behind the decoder layers under their Hugging Face names."""
    c = model.config
    if c.tie_word_embeddings:
        raise ConfigError(
            "algorithm rotate: the model ties its head to its embeddings, and the rotation folds the final "
            "norm into the head alone; quantize without rotate"
        )
    p = _Planner(c.hidden_size)
    prefix, decoder = model.decoder()
    _known(decoder, DECODER_PARTS, prefix.rstrip("."))
    p.add(f"{prefix}embed_tokens.weight", Residual(-1))
    final = p.norm(decoder.norm, f"{prefix}norm")
    p.add("lm_head.weight", Residual(-1, (final,)))
    for i, layer in enumerate(decoder.layers):
        p.layer(layer, f"{prefix}layers.{i}.")
    # an MTP layer's decoder layer is of the last MoE layer's kind (its family's mtp_model)
    like = c.moe_layers[-1] if c.moe_layers else c.num_layers - 1
    mtp = tuple(f"{prefix}layers.{c.num_layers + k}." for k in range(c.num_nextn_predict_layers))
    for layer_prefix in mtp:
        p.mtp(f"{prefix}layers.{like}.", layer_prefix, c.num_experts)
    return RotationPlan(c.hidden_size, p.steps, p.left_out, mtp)


class _Planner:
    def __init__(self, width: int):
        self.width = width
        self.steps: dict[str, tuple[Step, ...]] = {}
        self.left_out: list[str] = []

    def add(self, name: str, *steps: Step) -> None:
        self.steps[name] = self.steps.get(name, ()) + steps

    def norm(self, norm: nn.Module, name: str) -> Norm:
        if not isinstance(norm, RMSNorm):
            raise ConfigError(
                f"algorithm rotate: {name} ({type(norm).__name__}) is not an RMSNorm; quantize without rotate"
            )
        return self.identity(name, isinstance(norm, ZeroCenteredRMSNorm))

    def identity(self, name: str, centered: bool) -> Norm:
        """Norm `name` made the identity, its weight for its readers to fold."""
        self.add(f"{name}.weight", Identity(0.0 if centered else 1.0))
        return Norm(f"{name}.weight", centered)

    def reads(self, module: nn.Module, name: str, *norms: Norm) -> None:
        self.add(f"{name}.weight" if isinstance(module, Linear) else name, Residual(-1, norms))

    def writes(self, module: nn.Module, name: str) -> None:
        self.add(f"{name}.weight" if isinstance(module, Linear) else name, Residual(-2))
        if isinstance(module, Linear) and module.bias is not None:
            self.add(f"{name}.bias", Residual(-1))

    def layer(self, layer: nn.Module, prefix: str) -> None:
        _known(layer, {name for block in layer.blocks for name in (block.norm, block.mixer)}, prefix.rstrip("."))
        if (type(layer).enter, type(layer).leave) != (DecoderLayer.enter, DecoderLayer.leave):
            raise ConfigError(
                f"algorithm rotate: {prefix.rstrip('.')} ({type(layer).__name__}) joins its blocks by a residual "
                "rule the rotation does not know; quantize without rotate"
            )
        for block in layer.blocks:  # each block's norm, then what reads it and writes the stream
            norm = self.norm(getattr(layer, block.norm), f"{prefix}{block.norm}")
            mixer = getattr(layer, block.mixer)
            mixes = self.ffn if isinstance(mixer, (*MLPS, MoE)) else self.mixer
            mixes(mixer, f"{prefix}{block.mixer}.", norm)

    def mixer(self, attn: nn.Module, prefix: str, norm: Norm) -> None:
        if isinstance(attn, GQAttention):
            readers = names_of(attn, attn.input_readers())
        elif isinstance(attn, MLAttention):
            readers = ["q_a_proj" if attn.q_lora else "q_proj", "kv_a_proj_with_mqa"]
            readers += ["g_proj"] if attn.g_proj is not None else []
            readers += ["indexer.wk", "indexer.weights_proj"] if attn.indexer is not None else []
        elif isinstance(attn, GatedDeltaNet):
            split = ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"]
            readers = split if attn.split_projections else ["in_proj_qkvz", "in_proj_ba"]
        elif isinstance(attn, KimiDeltaAttention):
            readers = ["q_proj", "k_proj", "v_proj", "f_a_proj", "b_proj"]
            readers += ["g_proj"] if attn.full_rank_gate else ["g_a_proj"]
        elif isinstance(attn, Mamba2Mixer):
            readers = names_of(attn, attn.input_readers())
        else:
            raise ConfigError(
                f"algorithm rotate: {prefix.rstrip('.')} ({type(attn).__name__}) is a mixer the rotation does "
                "not know; quantize without rotate"
            )
        for r in readers:
            self.reads(attn.get_submodule(r), prefix + r, norm)
        out = "out_proj" if isinstance(attn, (GatedDeltaNet, Mamba2Mixer)) else "o_proj"
        self.writes(attn.get_submodule(out), prefix + out)
        self.values(attn, prefix)

    def values(self, attn: nn.Module, prefix: str) -> None:
        """R2 between each head's values and o_proj, where the attention allows it."""
        if isinstance(attn, GQAttention) and not attn.output_gate:
            d = attn.head_dim
            self.add(f"{prefix}v_proj.weight", PerHead(-2, d, 0, d))
            if attn.v_proj.bias is not None:
                self.add(f"{prefix}v_proj.bias", PerHead(-1, d, 0, d))
            self.add(f"{prefix}o_proj.weight", PerHead(-1, d, 0, d))
        elif isinstance(attn, MLAttention) and attn.g_proj is None:
            self.add(f"{prefix}kv_b_proj.weight", PerHead(-2, attn.nope + attn.v_dim, attn.nope, attn.v_dim))
            self.add(f"{prefix}o_proj.weight", PerHead(-1, attn.v_dim, 0, attn.v_dim))
        else:
            why = {
                GQAttention: "its output gate multiplies each channel",
                MLAttention: "its output gate multiplies each channel",
                GatedDeltaNet: "a norm sits between its values and out_proj",
                KimiDeltaAttention: "a norm sits between its values and o_proj",
                Mamba2Mixer: "a gated norm sits between its scan and out_proj",
            }[type(attn)]
            self.left_out.append(f"{prefix.rstrip('.')}: values left unrotated ({why})")

    def ffn(self, ffn: nn.Module, prefix: str, norm: Norm) -> None:
        if isinstance(ffn, MLPS):
            self.mlp(ffn, prefix, norm)
            return
        if not isinstance(ffn, MoE):
            raise ConfigError(
                f"algorithm rotate: {prefix.rstrip('.')} ({type(ffn).__name__}) is an MLP the rotation does not "
                "know; quantize without rotate"
            )
        self.reads(ffn.gate, f"{prefix}{names_of(ffn, (ffn.gate,))[0]}.weight", norm)
        if isinstance(ffn, LatentMoE):  # the experts compute in the latent, which is not rotated
            down, up = ffn.projections
            self.reads(getattr(ffn, down), f"{prefix}{down}", norm)
            self.writes(getattr(ffn, up), f"{prefix}{up}")
        else:
            leaf_in, leaf_out = ffn.experts.pieces.leaves
            self.reads(ffn.experts, f"{prefix}experts.{leaf_in}", norm)
            self.writes(ffn.experts, f"{prefix}experts.{leaf_out}")
            if ffn.experts.pieces.bias:  # down's bias lies along the stream, as a Linear's does
                self.add(f"{prefix}experts.{leaf_out}_bias", Residual(-1))
        if isinstance(ffn, GatedSharedExpertMoE):
            self.mlp(ffn.shared_expert, f"{prefix}shared_expert.", norm)
            self.reads(ffn.shared_expert_gate, f"{prefix}shared_expert_gate", norm)
        elif ffn.shared_experts is not None:
            self.mlp(ffn.shared_experts, f"{prefix}{names_of(ffn, (ffn.shared_experts,))[0]}.", norm)

    def mlp(self, mlp: GatedMLP | FusedGatedMLP | UngatedMLP, prefix: str, norm: Norm) -> None:
        for r in names_of(mlp, mlp.input_readers()):
            self.reads(mlp.get_submodule(r), f"{prefix}{r}", norm)
        self.writes(mlp.down_proj, f"{prefix}down_proj")

    def mtp(self, like: str, prefix: str, experts: int) -> None:
        """A multi-token-prediction layer (`prefix`): its embedding, eh_proj reading enorm's and hnorm's
        outputs side by side and writing the stream, a decoder layer as decoder layer `like`'s (its
        routed experts also under their per-expert source names, as convert carries them), its head
        behind its own norm."""
        self.add(f"{prefix}embed_tokens.weight", Residual(-1))
        halves = (self.identity(f"{prefix}enorm", False), self.identity(f"{prefix}hnorm", False))
        self.add(f"{prefix}eh_proj.weight", Residual(-1, halves), Residual(-2))
        for name, steps in list(self.steps.items()):
            if name.startswith(like):
                self.steps[prefix + name[len(like) :]] = tuple(_rebased(s, like, prefix) for s in steps)
        for ffn in ("mlp.", "block_sparse_moe."):
            for leaf, sources in (("w13", ("gate_proj", "up_proj")), ("w2", ("down_proj",))):
                steps = self.steps.get(f"{prefix}{ffn}experts.{leaf}")
                for e in range(experts if steps is not None else 0):
                    for src in sources:
                        self.steps[f"{prefix}{ffn}experts.{e}.{src}.weight"] = steps
        head_norm = self.identity(f"{prefix}shared_head.norm", False)
        self.add(f"{prefix}shared_head.head.weight", Residual(-1, (head_norm,)))


def _rebased(step: Step, like: str, prefix: str) -> Step:
    """`step` of a tensor under `like`, for the same tensor under `prefix`."""
    if not isinstance(step, Residual):
        return step
    return Residual(step.axis, tuple(Norm(prefix + n.name[len(like) :], n.centered) for n in step.norms))


def names_of(parent: nn.Module, modules: tuple[nn.Module, ...]) -> list[str]:
    """The names `modules` have inside `parent` (a MoE's `gate` or `router`, its shared experts under any name)."""
    names = {id(m): n for n, m in parent.named_modules()}
    return [names[id(m)] for m in modules]


def _known(module: nn.Module, parts: set[str], name: str) -> None:
    """Refuse a part of the stream's modules this plan does not know (attention residuals, ...)."""
    unknown = sorted({n for n, _ in module.named_children()} - parts)
    if unknown:
        raise ConfigError(
            f"algorithm rotate: {name}.{unknown[0]} touches the residual stream in a way the rotation does not "
            "model; quantize without rotate"
        )
