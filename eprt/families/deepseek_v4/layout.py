"""DeepSeek-V4's tensors, in the two spellings: the release's flat names (DeepSeek's own code) and
transformers 5.25's `save_pretrained`, which writes the same names under `model.` but for a few:

    release                                transformers' save_pretrained
    embed.weight                           model.embed_tokens.weight
    layers.N.<...>                         model.layers.N.<...> (the same <...>)
    layers.N.attn.kv_norm.weight           model.layers.N.attn.norm.weight (eprt: model.layers.N.attn.kv_norm)
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


# The attention's kv norm is `attn.kv_norm` in the release (DeepSeek's `Attention.kv_norm`) and in
# the model, but transformers' save_pretrained writes it `attn.norm` (its load renames every `.norm.`
# to `.kv_norm.`, its save undoes that everywhere): the one name inside a layer the spellings differ in.
KV_NORM = "attn.kv_norm.weight"


def in_layer(i: int, name: str, *shape: int, transformers_names: bool = False) -> TensorSpec:
    """Layer i's tensor `name`: `model.layers.i.name`, the release's `layers.i.name`, and the kv
    norm where the checkpoint is transformers' under the name its save_pretrained gives it."""
    alias = f"model.layers.{i}.attn.norm.weight" if transformers_names and name == KV_NORM else f"layers.{i}.{name}"
    return plain(f"model.layers.{i}.{name}", *shape, alias=alias)


def mtp_prefix(decoder: str, c: ModelConfig, k: int) -> str:
    """MTP layer k's tensors are under the release's `mtp.k.` only, whatever the decoder's prefix:
    transformers saves none."""
    return f"mtp.{k}."


def in_mtp(c: ModelConfig, k: int):
    prefix = mtp_prefix("", c, k)

    return lambda name, *shape: plain(f"{prefix}{name}", *shape)


def compressor(put, p: str, c: ModelConfig, rate: int, width: int, overlap: bool) -> list[TensorSpec]:
    """A compressor of `width`-wide entries, every `rate` tokens; overlapping windows (CSA's) hold
    two series side by side."""
    w, D = (2 if overlap else 1) * width, c.hidden_size
    return [
        put(f"{p}.ape", rate, w),
        put(f"{p}.wkv.weight", w, D),
        put(f"{p}.wgate.weight", w, D),
        put(f"{p}.norm.weight", width),
    ]


def attention(put, i: int, c: ModelConfig) -> list[TensorSpec]:
    """Layer i's attention (i past the decoder layers: an MTP layer's), each tensor named by `put`."""
    own, D, H = c.own, c.hidden_size, c.num_heads
    hd, g = own.head_dim, own.o_groups
    specs = [
        put("attn.attn_sink", H),
        put("attn.wq_a.weight", own.q_lora_rank, D),
        put("attn.q_norm.weight", own.q_lora_rank),
        put("attn.wq_b.weight", H * hd, own.q_lora_rank),
        put("attn.wkv.weight", hd, D),
        put(KV_NORM, hd),
        put("attn.wo_a.weight", g * own.o_lora_rank, H * hd // g),
        put("attn.wo_b.weight", D, g * own.o_lora_rank),
    ]
    kind = own.kind(i)
    if kind == SLIDING:
        return specs
    specs += compressor(put, "attn.compressor", c, own.rate(i), hd, overlap=kind == CSA)
    if kind == CSA:
        ihd = own.index_head_dim
        specs += [
            put("attn.indexer.wq_b.weight", own.index_n_heads * ihd, own.q_lora_rank),
            put("attn.indexer.weights_proj.weight", own.index_n_heads, D),
        ]
        specs += compressor(put, "attn.indexer.compressor", c, own.rate(i), ihd, overlap=True)
    return specs


def moe(put, i: int, c: ModelConfig, experts: str, stacked: str) -> list[TensorSpec]:
    """Layer i's MoE, each tensor named by `put`; its routed experts stored per expert under
    `experts` (`experts.E.w1`) and stacked under `stacked` (`stacked.w13`)."""
    m, D, E = c.moe, c.hidden_size, c.moe.num_experts
    specs = [put("ffn.gate.weight", E, D)]
    if i in c.own.hash_layers:
        specs.append(replace(put("ffn.gate.tid2eid", c.vocab_size, m.num_experts_per_tok), table=True))
    else:
        specs.append(put("ffn.gate.bias", E))
    storage = ExpertStorage(("w1", "w3", "w2"))
    for s in stacked_experts(experts, E, m.intermediate_size, D, pieces=pieces(c), storage=storage):
        specs.append(replace(s, name=f"{stacked}.{s.name.rsplit('.', 1)[1]}"))
    specs += [put(f"ffn.shared_experts.{w}.weight", *shape) for w, shape in shared(c).items()]
    return specs


def decoder_moe(i: int, c: ModelConfig) -> list[TensorSpec]:
    prefix = f"{'model.' if c.own.transformers_names else ''}layers.{i}.ffn.experts"
    return moe(lambda name, *shape: in_layer(i, name, *shape), i, c, prefix, f"model.layers.{i}.ffn.experts")


def hyper_connected(put, D: int, n: int) -> list[TensorSpec]:
    """A layer's two norms and the hyper-connections of its two blocks."""
    specs, mix = [put("attn_norm.weight", D), put("ffn_norm.weight", D)], (2 + n) * n
    for part in ("attn", "ffn"):
        specs += [put(f"hc_{part}_fn", mix, n * D), put(f"hc_{part}_base", mix), put(f"hc_{part}_scale", 3)]
    return specs


def shared(c: ModelConfig) -> dict[str, tuple[int, int]]:
    D, I = c.hidden_size, c.moe.intermediate_size
    return {"w1": (I, D), "w2": (D, I), "w3": (I, D)}


def layout(c: ModelConfig) -> Layout:
    D, n = c.hidden_size, c.own.hc_mult
    specs = [plain("model.embed_tokens.weight", c.vocab_size, D, alias=TOP["model.embed_tokens.weight"])]
    for i in range(c.num_layers):
        put = lambda name, *shape, i=i: in_layer(i, name, *shape, transformers_names=c.own.transformers_names)  # noqa: E731
        specs += hyper_connected(put, D, n) + attention(put, i, c) + decoder_moe(i, c)
    shapes = {"model.norm.weight": (D,), "model.hc_head.hc_fn": (n, n * D), "model.hc_head.hc_base": (n,)}
    shapes["model.hc_head.hc_scale"] = (1,)
    specs += [plain(name, *shape, alias=TOP[name]) for name, shape in shapes.items()]
    if not c.tie_word_embeddings:
        specs.append(plain("head.weight", c.vocab_size, D))
    # transformers saves no MTP layer: only the release's spelling has them to run
    mtp = () if c.own.transformers_names else mtp_layers(c)
    return Layout(tuple(specs), passthrough=MTP, mtp=mtp)


def mtp_layers(c: ModelConfig) -> tuple[TensorSpec, ...]:
    """The release's MTP layers (`mtp.K.`) as eprt runs them (eprt.families.deepseek_v4.model.DeepseekV4MTP)
    and convert carries them (under their own names, each routed expert apart): a decoder layer of
    their own kind (`kind(num_hidden_layers + K)`, routed by score), the embedding's and the
    streams' norms and projections (enorm, hnorm, e_proj, h_proj), and what its logits read: a norm
    and the streams' collapse (hc_head_*) before the model's own head."""
    D, n = c.hidden_size, c.own.hc_mult
    specs = []
    for k in range(c.num_nextn_predict_layers):
        put, i, p = in_mtp(c, k), c.num_layers + k, mtp_prefix("", c, k)
        specs += hyper_connected(put, D, n) + attention(put, i, c)
        specs += moe(put, i, c, f"{p}ffn.experts", f"{p}ffn.experts")
        own = {"enorm.weight": (D,), "hnorm.weight": (D,), "e_proj.weight": (D, D), "h_proj.weight": (D, D)}
        own |= {"norm.weight": (D,), "hc_head_fn": (n, n * D), "hc_head_base": (n,), "hc_head_scale": (1,)}
        specs += [put(name, *shape) for name, shape in own.items()]
    return tuple(specs)


def mtp_layout(c: ModelConfig) -> Layout:
    """The release's MTP layers one source tensor per spec (each routed expert's projections apart),
    as a checkpoint stores them: what eprt-make-tiny writes."""
    released = replace(c, own=replace(c.own, transformers_names=False))
    return Layout(tuple(piece for s in mtp_layers(released) for piece in per_source(s)))


def per_source(spec: TensorSpec) -> list[TensorSpec]:
    return [plain(source, *spec.as_piece().shape) for source in spec.sources] if spec.stacked else [spec]
