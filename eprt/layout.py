"""How a family's Hugging Face tensors map onto eprt tensors.

Every eprt tensor keeps its Hugging Face name except the routed experts, which are stacked
per layer with the expert index leading, one tensor per projection as `ExpertPieces` names it
(gated: `...experts.w13` [E, 2I, D], each expert's gate rows then its up rows, and
`...experts.w2` [E, D, I]; not gated: `w1` [E, I, D] and `w2`; a bias beside each where the
experts have them). Both conversion and export read this one table.

A tensor may have two Hugging Face spellings (`alias`): transformers 5 saves Kimi-Linear's dense MLP
under `block_sparse_moe.`, Moonshot's code and the release under `mlp.`. Convert reads either, and
the export writes it back under the one the source used.

A source may hold a layer's experts already stacked, one 3-D tensor per projection (`experts.gate_up_proj`
[E, 2I, D], gate rows first, and `experts.down_proj` [E, D, I]): Qwen3.5-MoE as released, and the
parameters of transformers 5's MoE modules. A stacked spec names that tensor in `fused`; its
bytes are the eprt tensor's, or a permutation of them the spec names (`transposed`: stored
[E, in, out], as GPT-OSS and Llama-4 do; `interleaved`: gate and up alternate along the
outputs, gate at even, up at odd, as GPT-OSS does), which convert undoes and export redoes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class TensorSpec:
    name: str  # eprt name
    shape: tuple[int, ...]  # eprt shape
    # Hugging Face names, row-major: eprt row r is the concatenation along dim 0 of
    # sources[r*per_row : (r+1)*per_row]. A plain tensor has one source and `stacked` False.
    sources: tuple[str, ...]
    stacked: bool = False
    per_row: int = 1
    # What each entry along dim 0 belongs to, when the source may store more entries than the
    # model reads (padding after them): Kimi-K3's A_log holds one per head, padded to 128 in the
    # release. The eprt tensor keeps the stored length; the model reads the first `shape[0]`.
    padded_per: str | None = None
    # A stacked tensor: the Hugging Face name of the one tensor that may hold it whole, in this
    # shape and orientation, in place of `sources`.
    fused: str | None = None
    # A plain tensor: the other Hugging Face name the source may hold it under, in its place.
    alias: str | None = None
    # How `fused` permutes the eprt tensor (the module docstring): its last two dims swapped, and
    # the `interleaved` pieces of each row (gate, up) alternating element by element along dim 1.
    transposed: bool = False
    interleaved: int = 1
    # An integer lookup table (DeepSeek-V4's token-to-expert `tid2eid`): kept in the source's
    # integer dtype through convert, the run and export, never cast nor quantized.
    table: bool = False

    def source_shape(self) -> tuple[int, ...]:
        if not self.stacked:
            return self.fused_shape() if self.permuted else self.shape
        return (self.shape[1] // self.per_row, *self.shape[2:])

    @property
    def permuted(self) -> bool:
        """Whether the fused tensor holds this one's elements in another order."""
        return self.transposed or self.interleaved > 1

    def as_fused(self) -> "TensorSpec":
        """The one tensor `fused` names, as a plain spec: read whole, its order named (`permuted`)."""
        return replace(self, sources=(self.fused,), stacked=False, per_row=1)

    def as_piece(self) -> "TensorSpec":
        """One of a stacked spec's per-expert sources, as a plain spec of its own shape."""
        return replace(self, shape=self.source_shape(), stacked=False, per_row=1, transposed=False, interleaved=1)

    def fused_shape(self) -> tuple[int, ...]:
        """The shape of the one tensor `fused` names."""
        return (*self.shape[:-2], self.shape[-1], self.shape[-2]) if self.transposed else self.shape

    def from_fused(self, t):
        """The eprt tensor from the fused one (a torch tensor of `fused_shape()`): a view."""
        return self.deinterleave(t.transpose(-2, -1) if self.transposed else t)

    def to_fused(self, t):
        """The fused tensor from the eprt one: `from_fused` undone, contiguous."""
        t = self.interleave(t)
        return (t.transpose(-2, -1) if self.transposed else t).contiguous()

    def deinterleave(self, t):
        """[E, n, ...] with the `interleaved` pieces alternating along dim 1 as eprt holds them, each
        piece's entries together: (i, piece) -> (piece, i). Also an encoded source's components, whose
        dim 1 follows the weight's outputs (eprt.storage.mxfp4_blocks)."""
        if self.interleaved == 1:
            return t
        E, n, k = *t.shape[:2], self.interleaved
        return t.unflatten(1, (n // k, k)).transpose(1, 2).reshape(E, n, *t.shape[2:])

    def interleave(self, t):
        """`deinterleave` undone."""
        if self.interleaved == 1:
            return t
        E, n, k = *t.shape[:2], self.interleaved
        return t.unflatten(1, (k, n // k)).transpose(1, 2).reshape(E, n, *t.shape[2:])

    def shape_problem(self, shape: tuple[int, ...]) -> str | None:
        """Why a source tensor of `shape` cannot be this one (after `tensor NAME `), or None."""
        want = self.source_shape()
        if tuple(shape) == want:
            return None
        if self.padded_per is None or len(shape) != len(want) or tuple(shape[1:]) != want[1:]:
            longer = " or longer along dim 0" if self.padded_per else ""
            return f"has shape {list(shape)} but config.json implies {list(want)}{longer}"
        if shape[0] > want[0]:
            return None
        return (
            f"holds {shape[0]} entries but config.json implies {want[0]} {self.padded_per}s, which need one "
            f"each (padding may follow); fix the {self.padded_per} count in config.json, or use a checkpoint "
            f"that stores at least {want[0]} entries"
        )

    def stored_as(self, shape: tuple[int, ...]) -> "TensorSpec":
        """This spec with the length its (padded) source stores."""
        return self if tuple(shape) == self.shape else replace(self, shape=tuple(shape))

    @property
    def is_expert(self) -> bool:
        return self.stacked


@dataclass(frozen=True)
class Layout:
    specs: tuple[TensorSpec, ...]
    # Tensors the model does not run but that must travel through convert and export
    # unchanged (DeepSeek-V3's MTP layers, a VLM's vision tower).
    passthrough: tuple[str, ...] = ()  # regexes over Hugging Face names
    # The two below are the family table's (eprt.families.Family.layout fills them in):
    # tensors a `--dtype` conversion leaves in their source dtype, because the reference
    # computes with them in fp32 (DeepSeek's router and its correction bias),
    precise: tuple[str, ...] = ()  # regexes over eprt names
    # and modules no recipe quantizes.
    unquantized: tuple[str, ...] = ()  # regexes over module names
    # The multi-token-prediction layers eprt runs and may quantize (DeepSeek-V3's, GLM-4.5's,
    # DeepSeek-V4's), as convert carries them (their names also match `passthrough`): under their
    # Hugging Face names, each routed expert apart; a stacked spec here names them in `sources`, no
    # eprt tensor holds them.
    mtp: tuple[TensorSpec, ...] = ()

    def linear_modules(self, mtp: bool = False) -> dict[str, TensorSpec]:
        """Every module a recipe may quantize, by module name: 2-D `.weight`s and stacked experts;
        with `mtp`, those of the multi-token-prediction layers instead.

        A MoE layer's routed experts are one module (`...experts`), with the stacked `w13`
        (gate and up of each expert) and `w2` (down)."""
        out = {}
        for spec in self.mtp if mtp else self.specs:
            if spec.stacked:
                out.setdefault(spec.name.rsplit(".", 1)[0], spec)
            elif spec.name.endswith(".weight") and len(spec.shape) == 2:
                module = spec.name[: -len(".weight")]
                if not any(re.fullmatch(p, module) for p in self.unquantized):
                    out[module] = spec
        return out

    def by_source(self) -> dict[str, TensorSpec]:
        return {s: spec for spec in self.specs for s in spec.sources}

    def is_passthrough(self, hf_name: str) -> bool:
        return any(re.fullmatch(p, hf_name) for p in self.passthrough)

    def is_precise(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.precise)


_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """The decoder layer a tensor belongs to, or None for embeddings, final norm and head."""
    m = _LAYER.search(name)
    return int(m.group(1)) if m else None


@dataclass(frozen=True)
class ClampedSwiGLU:
    """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit):
    GPT-OSS's and MiniMax-M3's gated activation."""

    alpha: float = 1.702
    limit: float = 7.0


@dataclass(frozen=True)
class SwiGLULimit:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): DeepSeek-V4's SwiGLU, bounded."""

    limit: float


# The stacked projections' eprt names: (their place among a module's two, 0 the one its input goes
# through and 1 down; how many projections each expert's row holds end to end). The one spelling.
EXPERT_LEAVES = {"w13": (0, 2), "w1": (0, 1), "w2": (1, 1)}


@dataclass(frozen=True)
class ExpertPieces:
    """What a family's routed experts are made of: gated (down(act(gate x, up x))) or not
    (down(act(up x))), a bias on each projection or none, and the activation, by name ("silu":
    silu(gate) * up; "relu2": relu(up)^2) or as a `ClampedSwiGLU` or a `SwiGLULimit`. The model resolves the
    activation (eprt.models.moe); the stacked tensors are named by `leaves`."""

    gated: bool = True
    bias: bool = False
    activation: str | ClampedSwiGLU | SwiGLULimit = "silu"

    @property
    def leaves(self) -> tuple[str, str]:
        """The eprt names of the stacked projections under `...experts`: the one the experts'
        input goes through (gate and up end to end, or up), and down."""
        return ("w13", "w2") if self.gated else ("w1", "w2")

    @property
    def fan(self) -> int:
        """How many projections the first stacked tensor holds end to end in each expert's row."""
        return EXPERT_LEAVES[self.leaves[0]][1]


GATED_SILU = ExpertPieces()


@dataclass(frozen=True)
class ExpertStorage:
    """How a checkpoint stores a layer's routed experts: per expert (`prefix.E.{name}{suffix}`, the
    projections `names` give: gate, up, down, or up, down when not gated), and/or fused, one 3-D
    tensor per projection (`fused`: the first and down's names, their biases `{name}_bias`),
    `transposed` ([E, in, out]) and `interleaved` (gate and up alternating along the outputs)."""

    names: tuple[str, ...] = ("gate_proj", "up_proj", "down_proj")
    suffix: str = ".weight"
    fused: tuple[str, str] | None = None
    transposed: bool = False
    interleaved: bool = False

    @classmethod
    def named(cls, gate: str | None, up: str, down: str, suffix: str = ".weight") -> "ExpertStorage":
        """Per-expert names, with transformers' fused form beside them where the names are transformers'
        (a family with its own names has no fused form to read)."""
        names = (up, down) if gate is None else (gate, up, down)
        transformers_names = names[-2:] == ("up_proj", "down_proj") and gate in (None, "gate_proj")
        fused = (
            ("gate_up_proj" if gate else "up_proj", "down_proj") if transformers_names and suffix == ".weight" else None
        )
        return cls(names, suffix, fused)


def stacked_experts(
    prefix: str,
    num_experts: int,
    width: int,
    hidden: int,
    gate: str | None = "gate_proj",
    up: str = "up_proj",
    down: str = "down_proj",
    suffix: str = ".weight",
    *,
    pieces: ExpertPieces = GATED_SILU,
    storage: ExpertStorage | None = None,
) -> list[TensorSpec]:
    """The stacked expert tensors of one MoE layer (`pieces.leaves`, then their biases), read from
    per-expert `prefix.E.{gate,up,down}` or from the fused tensors `storage` names (default: the
    names given here, and transformers' fused form where they are transformers')."""
    storage = storage or ExpertStorage.named(gate if pieces.gated else None, up, down, suffix)
    if len(storage.names) != pieces.fan + 1:
        raise ValueError(
            f"{prefix}: {'gated' if pieces.gated else 'ungated'} experts name {pieces.fan + 1} projections, got {storage.names}"
        )
    first, second = pieces.leaves
    shapes = {first: (num_experts, pieces.fan * width, hidden), second: (num_experts, hidden, width)}
    names = {first: storage.names[:-1], second: storage.names[-1:]}
    fused = dict(zip((first, second), storage.fused or (None, None)))
    # (what eprt and a fused source append for it, what a per-expert source does): weights, then biases
    kinds = [("", storage.suffix)] + ([("_bias", ".bias")] if pieces.bias else [])
    specs = []
    for bias, source_suffix in kinds:
        for leaf, shape in shapes.items():
            parts = names[leaf]
            specs.append(
                TensorSpec(
                    f"{prefix}.{leaf}{bias}",
                    shape[:2] if bias else shape,
                    tuple(f"{prefix}.{e}.{p}{source_suffix}" for e in range(num_experts) for p in parts),
                    stacked=True,
                    per_row=len(parts),
                    fused=f"{prefix}.{fused[leaf]}{bias}" if fused[leaf] else None,
                    transposed=storage.transposed and not bias,  # a bias [E, out] has no in to swap
                    interleaved=len(parts) if storage.interleaved else 1,
                )
            )
    return specs


def plain(name: str, *shape: int, alias: str | None = None) -> TensorSpec:
    return TensorSpec(name, tuple(shape), (name,), alias=alias)


def decoder_specs(c, layer, final: tuple[TensorSpec, ...] = ()) -> list[TensorSpec]:
    """A decoder's tensors as most families name them: the embedding; each layer's two norms, then
    `layer(prefix, i)`'s tensors (`model.layers.{i}`); `final`, the final norm and the head (none where
    the embedding is tied)."""
    D = c.hidden_size
    specs = [plain("model.embed_tokens.weight", c.vocab_size, D)]
    for i in range(c.num_layers):
        p = f"model.layers.{i}"
        specs += [plain(f"{p}.input_layernorm.weight", D), plain(f"{p}.post_attention_layernorm.weight", D)]
        specs += layer(p, i)
    specs += [*final, plain("model.norm.weight", D)]
    if not c.tie_word_embeddings:
        specs.append(plain("lm_head.weight", c.vocab_size, D))
    return specs


def gated_mlp(prefix: str, hidden: int, width: int, alias: str | None = None) -> list[TensorSpec]:
    """`prefix.{gate,up,down}_proj`: a dense MLP or the shared experts; the source may spell
    `prefix` as `alias` instead."""
    shapes = {"gate_proj": (width, hidden), "up_proj": (width, hidden), "down_proj": (hidden, width)}
    return [
        TensorSpec(
            f"{prefix}.{p}.weight", shape, (f"{prefix}.{p}.weight",), alias=f"{alias}.{p}.weight" if alias else None
        )
        for p, shape in shapes.items()
    ]


def mla_attention(prefix: str, c) -> list[TensorSpec]:
    """Multi-head latent attention's tensors (DeepSeek-V3, Kimi): q through a low-rank pair when
    `c.mla.q_lora_rank` is set, the shared latent for keys and values, the output projection."""
    m, D, H = c.mla, c.hidden_size, c.num_heads
    d = m.qk_nope_head_dim + m.qk_rope_head_dim
    if m.q_lora_rank:
        specs = [
            plain(f"{prefix}.q_a_proj.weight", m.q_lora_rank, D),
            plain(f"{prefix}.q_a_layernorm.weight", m.q_lora_rank),
            plain(f"{prefix}.q_b_proj.weight", H * d, m.q_lora_rank),
        ]
    else:
        specs = [plain(f"{prefix}.q_proj.weight", H * d, D)]
    return specs + [
        plain(f"{prefix}.kv_a_proj_with_mqa.weight", m.kv_lora_rank + m.qk_rope_head_dim, D),
        plain(f"{prefix}.kv_a_layernorm.weight", m.kv_lora_rank),
        plain(f"{prefix}.kv_b_proj.weight", H * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank),
        plain(f"{prefix}.o_proj.weight", D, H * m.v_head_dim),
    ]


def gqa_attention(prefix: str, c, whole_qk_norm: bool = False) -> list[TensorSpec]:
    """Grouped-query attention's tensors (Qwen3, GLM-4.5, Qwen3-Next, MiniMax-M2): q/k/v/o, the
    q/k norms under `c.gqa.qk_norm` (one head wide, or with `whole_qk_norm` as wide as the whole
    projection: MiniMax-M2), biases under `qkv_bias` and `output_bias`; under `c.gqa.output_gate`
    q_proj holds each head's gate beside its query."""
    g, D = c.gqa, c.hidden_size
    q, kv = c.num_heads * g.head_dim, g.num_kv_heads * g.head_dim
    q_rows = 2 * q if g.output_gate else q
    specs = [
        plain(f"{prefix}.q_proj.weight", q_rows, D),
        plain(f"{prefix}.k_proj.weight", kv, D),
        plain(f"{prefix}.v_proj.weight", kv, D),
        plain(f"{prefix}.o_proj.weight", D, q),
    ]
    if g.qk_norm:
        q_norm, k_norm = (q, kv) if whole_qk_norm else (g.head_dim, g.head_dim)
        specs += [plain(f"{prefix}.q_norm.weight", q_norm), plain(f"{prefix}.k_norm.weight", k_norm)]
    if g.qkv_bias:
        specs += [
            plain(f"{prefix}.q_proj.bias", q_rows),
            plain(f"{prefix}.k_proj.bias", kv),
            plain(f"{prefix}.v_proj.bias", kv),
        ]
    if g.output_bias:
        specs.append(plain(f"{prefix}.o_proj.bias", D))
    return specs
