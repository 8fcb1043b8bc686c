"""DeepSeek-V4's tensors, in the two spellings: the release's flat names (DeepSeek's own code) and
transformers 5.25's `save_pretrained`, which writes the same names under `model.` but for a few:

    release                                transformers' save_pretrained
    embed.weight                           model.embed_tokens.weight
    layers.N.<...>                         model.layers.N.<...> (the same <...>)
    norm.weight                            model.norm.weight
    hc_head_fn / hc_head_base / _scale     model.hc_head.hc_fn / hc_base / hc_scale
    head.weight                            head.weight
    mtp.K.<...>                            (not saved: transformers does not build the MTP layers)

eprt names every tensor as transformers saves it, the release's name its `alias`, and stacks each
layer's routed experts (`layers.N.ffn.experts.E.w1 / w3 / w2`) into `ffn.experts.w13` / `w2`; the
MTP layers travel through unchanged.
"""

from __future__ import annotations

from dataclasses import replace

from eprt.config import ModelConfig
from eprt.families.deepseek_v4.config import CSA, SLIDING
from eprt.layout import ExpertPieces, ExpertStorage, Layout, SwiGLULimit, TensorSpec, plain, stacked_experts

MTP = (r"(model\.)?mtp\.\d+\..+",)
TOP = {
    "model.embed_tokens.weight": "embed.weight",
    "model.norm.weight": "norm.weight",
    "model.hc_head.hc_fn": "hc_head_fn",
    "model.hc_head.hc_base": "hc_head_base",
    "model.hc_head.hc_scale": "hc_head_scale",
}


def pieces(c: ModelConfig) -> ExpertPieces:
    """The routed experts: SwiGLU with the gate clamped above and up both ways at swiglu_limit."""
    return ExpertPieces(activation=SwiGLULimit(c.own.swiglu_limit))


def in_layer(i: int, name: str, *shape: int) -> TensorSpec:
    """Layer i's tensor `name`: `model.layers.i.name`, the release's `layers.i.name`."""
    return plain(f"model.layers.{i}.{name}", *shape, alias=f"layers.{i}.{name}")


def compressor(i: int, p: str, c: ModelConfig, rate: int, width: int, overlap: bool) -> list[TensorSpec]:
    """A compressor of `width`-wide entries, every `rate` tokens; overlapping windows (CSA's) hold
    two series side by side."""
    w, D = (2 if overlap else 1) * width, c.hidden_size
    return [
        in_layer(i, f"{p}.ape", rate, w),
        in_layer(i, f"{p}.wkv.weight", w, D),
        in_layer(i, f"{p}.wgate.weight", w, D),
        in_layer(i, f"{p}.norm.weight", width),
    ]


def attention(i: int, c: ModelConfig) -> list[TensorSpec]:
    own, D, H = c.own, c.hidden_size, c.num_heads
    hd, g = own.head_dim, own.o_groups
    specs = [
        in_layer(i, "attn.attn_sink", H),
        in_layer(i, "attn.wq_a.weight", own.q_lora_rank, D),
        in_layer(i, "attn.q_norm.weight", own.q_lora_rank),
        in_layer(i, "attn.wq_b.weight", H * hd, own.q_lora_rank),
        in_layer(i, "attn.wkv.weight", hd, D),
        in_layer(i, "attn.norm.weight", hd),
        in_layer(i, "attn.wo_a.weight", g * own.o_lora_rank, H * hd // g),
        in_layer(i, "attn.wo_b.weight", D, g * own.o_lora_rank),
    ]
    kind = own.layer_kinds[i]
    if kind == SLIDING:
        return specs
    specs += compressor(i, "attn.compressor", c, own.rate(i), hd, overlap=kind == CSA)
    if kind == CSA:
        ihd = own.index_head_dim
        specs += [
            in_layer(i, "attn.indexer.wq_b.weight", own.index_n_heads * ihd, own.q_lora_rank),
            in_layer(i, "attn.indexer.weights_proj.weight", own.index_n_heads, D),
        ]
        specs += compressor(i, "attn.indexer.compressor", c, own.rate(i), ihd, overlap=True)
    return specs


def moe(i: int, c: ModelConfig) -> list[TensorSpec]:
    m, D, E = c.moe, c.hidden_size, c.moe.num_experts
    specs = [in_layer(i, "ffn.gate.weight", E, D)]
    if i in c.own.hash_layers:
        specs.append(replace(in_layer(i, "ffn.gate.tid2eid", c.vocab_size, m.num_experts_per_tok), table=True))
    else:
        specs.append(in_layer(i, "ffn.gate.bias", E))
    prefix = f"{'model.' if c.own.transformers_names else ''}layers.{i}.ffn.experts"
    storage = ExpertStorage(("w1", "w3", "w2"))
    for s in stacked_experts(prefix, E, m.intermediate_size, D, pieces=pieces(c), storage=storage):
        specs.append(replace(s, name=f"model.layers.{i}.ffn.experts.{s.name.rsplit('.', 1)[1]}"))
    specs += [in_layer(i, f"ffn.shared_experts.{w}.weight", *shape) for w, shape in shared(c).items()]
    return specs


def shared(c: ModelConfig) -> dict[str, tuple[int, int]]:
    D, I = c.hidden_size, c.moe.intermediate_size
    return {"w1": (I, D), "w2": (D, I), "w3": (I, D)}


def layout(c: ModelConfig) -> Layout:
    D, n = c.hidden_size, c.own.hc_mult
    mix = (2 + n) * n
    specs = [plain("model.embed_tokens.weight", c.vocab_size, D, alias=TOP["model.embed_tokens.weight"])]
    for i in range(c.num_layers):
        specs += [in_layer(i, "attn_norm.weight", D), in_layer(i, "ffn_norm.weight", D)]
        for part in ("attn", "ffn"):
            specs += [
                in_layer(i, f"hc_{part}_fn", mix, n * D),
                in_layer(i, f"hc_{part}_base", mix),
                in_layer(i, f"hc_{part}_scale", 3),
            ]
        specs += attention(i, c) + moe(i, c)
    shapes = {"model.norm.weight": (D,), "model.hc_head.hc_fn": (n, n * D), "model.hc_head.hc_base": (n,)}
    shapes["model.hc_head.hc_scale"] = (1,)
    specs += [plain(name, *shape, alias=TOP[name]) for name, shape in shapes.items()]
    if not c.tie_word_embeddings:
        specs.append(plain("head.weight", c.vocab_size, D))
    return Layout(tuple(specs), passthrough=MTP)


def mtp_layout(c: ModelConfig) -> Layout:
    """The release's MTP layers (`mtp.K.`), which eprt carries without running, one source tensor
    per spec: a decoder layer like the last (its tensors under the release's names), plus the
    embedding's and the hidden state's norms and projections (enorm, hnorm, e_proj, h_proj), its
    final norm and the streams' collapse (hc_head_*)."""
    D, n, last = c.hidden_size, c.own.hc_mult, c.num_layers - 1
    released = layout(replace(c, own=replace(c.own, transformers_names=False)))
    inner = [s for s in released.specs if s.name.startswith(f"model.layers.{last}.")]
    own = {"enorm.weight": (D,), "hnorm.weight": (D,), "e_proj.weight": (D, D), "h_proj.weight": (D, D)}
    own |= {"norm.weight": (D,), "hc_head_fn": (n, n * D), "hc_head_base": (n,), "hc_head_scale": (1,)}
    specs = []
    for k in range(c.num_nextn_predict_layers):
        for s in inner:
            for source in (s.alias,) if s.alias else s.sources:
                specs.append(plain(f"mtp.{k}.{source.split('.', 2)[2]}", *s.as_piece().shape))
        specs += [plain(f"mtp.{k}.{name}", *shape) for name, shape in own.items()]
    return Layout(tuple(specs))
