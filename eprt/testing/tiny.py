"""Tiny random Hugging Face checkpoints in the real layout: the built-in model of the demo and the tests."""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass

import torch
from safetensors.torch import save

from eprt.families import Family, parse_hf_config, reader_for
from eprt.families.deepseek_v4 import layout as deepseek_v4_layout
from eprt.families.nemotron_h import layout as nemotron_h
from eprt.layout import EXPERT_LEAVES, Layout, TensorSpec, plain
from eprt.quant.formats.e2m1 import E2M1_MAX
from eprt.quant.formats.e8m0 import checked_scales
from eprt.quant.formats.mxfp4 import quantize_mxfp4
from eprt.storage.atomic import atomic_output_dir, copy_files, write_file
from eprt.storage.encodings import component_names, expand_blocks, matches
from eprt.storage.hf_files import CONFIG, GENERATION_CONFIG, SINGLE, TOKENIZER, shard_name, write_index, write_json
from eprt.storage.mxfp4_blocks import RELEASE_QUANTIZATION_CONFIG

TINY_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "tiny")  # package data
TOKENIZER_FILES = [TOKENIZER, "tokenizer_config.json", "special_tokens_map.json", GENERATION_CONFIG]
# The dtype of the checkpoint's weights (`dtype`), and its config.json spelling
WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
WEIGHT_DTYPE_NAMES = {"bf16": "bfloat16", "fp32": "float32"}


# Families whose releases store the router's weight in fp32 too (MiniMax-M3's, as vLLM loads it)
ROUTER_WEIGHT_FP32 = {"minimax_m3_vl", "minimax_m3_vl_text"}


def stored_fp32(family: Family, name: str) -> bool:
    """Whether the released checkpoints store tensor `name` in fp32 whatever their dtype: what the
    family keeps in fp32 (the router's correction bias, KDA's decay parameters), except the
    router's weight, which most store in the checkpoint's dtype and the reference casts up."""
    return family.keeps_fp32(name) and (not name.endswith(".weight") or family.name in ROUTER_WEIGHT_FP32)


def families() -> list[str]:
    return sorted(
        f[:-5] for f in os.listdir(TINY_DIR) if f.endswith(".json") and f[:-5] not in {n[:-5] for n in TOKENIZER_FILES}
    )


# a tiny family that runs another's model under its own name: a run across every model leaves it out
SAME_MODEL_AS = {
    "qwen3_5_moe_text": "qwen3_next",
    "mistral4_vlm": "mistral4",
    "llama4_text": "llama4",
    "kimi_vl": "kimi_k25",  # the VLM's language model, without the vision tower beside it
}


def distinct_models() -> list[str]:
    """The tiny families, each model once (`SAME_MODEL_AS`)."""
    return [f for f in families() if f not in SAME_MODEL_AS]


def tiny_config(family: str, **overrides) -> dict:
    path = os.path.join(TINY_DIR, f"{family}.json")
    if not os.path.isfile(path):
        raise ValueError(f"no tiny config for {family!r}; choose one of {', '.join(families())}")
    with open(path) as f:
        return {**json.load(f), **overrides}


def init(name: str, shape: tuple[int, ...], g: torch.Generator) -> torch.Tensor:
    """Random values with roughly the statistics of a trained model, per kind of tensor."""
    if name.endswith("e_score_correction_bias"):
        return 0.1 * torch.randn(shape, generator=g)
    if name.endswith(".A_log"):  # KDA decay rates exp(A_log) in [1, 16]
        return torch.empty(shape).uniform_(1.0, 16.0, generator=g).log()
    if name.endswith(".dt_bias"):  # softplus(dt_bias) in [1e-3, 1e-1]
        dt = torch.empty(shape).uniform_(math.log(1e-3), math.log(1e-1), generator=g).exp()
        return dt + torch.log(-torch.expm1(-dt))
    if name.endswith("_res_proj.weight"):  # attention-residual queries: mixtures far from uniform
        return 0.1 * torch.randn(shape, generator=g)
    if name.endswith(".bias"):  # projection and LayerNorm biases: small, around 0
        return 0.1 * torch.randn(shape, generator=g)
    if len(shape) == 1:  # norms
        return 1.0 + 0.1 * torch.randn(shape, generator=g)
    if re.search(
        r"\.((mlp|block_sparse_moe|mixer|ffn)\.gate|feed_forward\.router)\.weight$", name
    ):  # routers: spread enough that routing is not a tie
        return 0.5 * torch.randn(shape, generator=g)
    return 0.02 * torch.randn(shape, generator=g) * (5.0 if "embed_tokens" in name else 1.0)


def expert_table(shape: tuple[int, ...], num_experts: int, g: torch.Generator) -> torch.Tensor:
    """A hash-routing table [vocab, k] (DeepSeek-V4's tid2eid): k distinct experts per token, int32 as released."""
    return torch.rand(shape[0], num_experts, generator=g).argsort(-1)[:, : shape[1]].to(torch.int32)


def released_shape(spec: TensorSpec) -> tuple[int, ...]:
    """A source tensor's shape as the released checkpoints store it: a padded one (Kimi-K3's
    A_log, 128 entries for 96 heads) to the next multiple of 128."""
    shape = spec.source_shape()
    if spec.padded_per is None:
        return shape
    return (128 * math.ceil(shape[0] / 128), *shape[1:])


def vision_tensors(hidden: int, g: torch.Generator, model_type: str) -> dict[str, torch.Tensor]:
    """A few tensors of a VLM's vision tower and projector, which eprt carries through untouched."""
    if model_type == "qwen3_5_moe":
        shapes = {
            "model.visual.patch_embed.proj.weight": (16, 3, 2, 4, 4),
            "model.visual.pos_embed.weight": (16, 16),
            "model.visual.blocks.0.attn.qkv.weight": (48, 16),
            "model.visual.blocks.0.attn.qkv.bias": (48,),
            "model.visual.blocks.0.norm1.weight": (16,),
            "model.visual.merger.linear_fc1.weight": (64, 64),
            "model.visual.merger.linear_fc2.weight": (hidden, 64),
        }
        return {name: init(name, shape, g) for name, shape in shapes.items()}
    if model_type == "mistral3":  # Pixtral's tower and Mistral3's projector, as the tiny config sizes them
        v = "vision_tower."
        shapes = {
            v + "patch_conv.weight": (16, 3, 4, 4),
            v + "ln_pre.weight": (16,),
            v + "transformer.layers.0.attention_norm.weight": (16,),
            v + "transformer.layers.0.attention.q_proj.weight": (16, 16),
            v + "transformer.layers.0.feed_forward.gate_proj.weight": (32, 16),
            "multi_modal_projector.norm.weight": (16,),
            "multi_modal_projector.patch_merger.merging_layer.weight": (16, 64),
            "multi_modal_projector.linear_1.weight": (hidden, 16),
            "multi_modal_projector.linear_2.weight": (hidden, hidden),
        }
        return {name: init(name, shape, g) for name, shape in shapes.items()}
    if model_type == "minimax_m3_vl":
        shapes = {
            "vision_tower.vision_model.embeddings.patch_embedding.weight": (16, 3, 2, 14, 14),
            "vision_tower.vision_model.pre_layrnorm.weight": (16,),
            "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight": (16, 16),
            "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.bias": (16,),
            "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight": (32, 16),
            "multi_modal_projector.linear_1.weight": (32, 16),
            "multi_modal_projector.linear_2.weight": (hidden, 32),
            "patch_merge_mlp.linear_1.weight": (32, 4 * hidden),
            "patch_merge_mlp.linear_2.weight": (hidden, 32),
        }
        return {name: init(name, shape, g) for name, shape in shapes.items()}
    if model_type == "llama4":
        shapes = {
            "vision_model.patch_embedding.linear.weight": (16, 48),
            "vision_model.positional_embedding_vlm": (5, 16),
            "vision_model.model.layers.0.self_attn.q_proj.weight": (16, 16),
            "vision_model.model.layers.0.self_attn.q_proj.bias": (16,),
            "vision_model.layernorm_post.weight": (16,),
            "vision_model.vision_adapter.mlp.fc1.weight": (32, 64),
            "multi_modal_projector.linear_1.weight": (hidden, 32),
        }
        return {name: init(name, shape, g) for name, shape in shapes.items()}
    if model_type == "nemotron_h_omni":  # RADIO, its final norm and projector (mlp1), the sound encoder's
        shapes = {
            "vision_model.radio_model.model.patch_generator.embedder.weight": (16, 48),
            "vision_model.radio_model.model.blocks.0.attn.qkv.weight": (48, 16),
            "vision_model.radio_model.model.blocks.0.attn.qkv.bias": (48,),
            "vision_model.radio_model.model.blocks.0.norm1.weight": (16,),
            "vision_projector.vision_final_layernorm.weight": (16,),
            "mlp1.0.weight": (64,),
            "mlp1.1.weight": (32, 64),
            "mlp1.3.weight": (hidden, 32),
            "sound_encoder.encoder.layers.0.feed_forward1.linear1.weight": (32, 16),
            "sound_projection.linear1.weight": (32, 16),
            "sound_projection.linear2.weight": (hidden, 32),
        }
        return {name: init(name, shape, g) for name, shape in shapes.items()}
    if model_type == "kimi_vl":  # MoonViT and its projector (patches merged 2 x 2)
        shapes = {
            "vision_tower.patch_embed.proj.weight": (16, 3, 2, 2),
            "vision_tower.patch_embed.pos_emb.weight": (4, 4, 16),
            "vision_tower.encoder.blocks.0.wqkv.weight": (48, 16),
            "vision_tower.encoder.blocks.0.wqkv.bias": (48,),
            "vision_tower.encoder.blocks.0.wo.weight": (16, 16),
            "vision_tower.encoder.blocks.0.norm0.weight": (16,),
            "vision_tower.encoder.blocks.0.mlp.fc0.weight": (32, 16),
            "vision_tower.encoder.final_layernorm.weight": (16,),
            "multi_modal_projector.pre_norm.weight": (16,),
            "multi_modal_projector.linear_1.weight": (64, 64),
            "multi_modal_projector.linear_1.bias": (64,),
            "multi_modal_projector.linear_2.weight": (hidden, 64),
        }
        return {name: init(name, shape, g) for name, shape in shapes.items()}
    shapes = {
        "vision_tower.patch_embed.proj.weight": (16, 3, 2, 2),
        "vision_tower.patch_embed.proj.bias": (16,),
        "vision_tower.encoder.blocks.0.wqkv.weight": (48, 16),
        "vision_tower.encoder.blocks.0.wqkv.bias": (48,),
        "vision_tower.encoder.final_layernorm.weight": (16,),
        "mm_projector.pre_norm.weight": (16,),
        "mm_projector.proj.0.weight": (64, 64),
        "mm_projector.proj.2.weight": (hidden, 64),
    }
    return {name: init(name, shape, g) for name, shape in shapes.items()}


def mtp_layout(hf: dict) -> Layout:
    """DeepSeek-V3's multi-token-prediction layers: a decoder layer plus its own norms and projection
    (a family that stores them otherwise names them in its layout module: `MTP_LAYERS`)."""
    n, k = hf["num_hidden_layers"], hf.get("num_nextn_predict_layers", 0)
    big = parse_hf_config({**hf, "num_hidden_layers": n + k, "num_nextn_predict_layers": 0})
    D, vocab = big.hidden_size, big.vocab_size
    specs = []
    for layer in range(n, n + k):
        p = f"model.layers.{layer}."
        specs += [s for s in reader_for(big.model_type, "tiny").layout(big).specs if s.name.startswith(p)]
        specs += [
            plain(p + "enorm.weight", D),
            plain(p + "hnorm.weight", D),
            plain(p + "eh_proj.weight", D, 2 * D),
            plain(p + "embed_tokens.weight", vocab, D),
            plain(p + "shared_head.norm.weight", D),
            plain(p + "shared_head.head.weight", vocab, D),
        ]
    return Layout(tuple(specs))


# The families whose multi-token-prediction layers are not stored as DeepSeek-V3's: their tensors,
# from the family's layout module
MTP_LAYERS = {
    "nemotron_h": nemotron_h.mtp_layers,
    "nemotron_h_omni": lambda c: nemotron_h.mtp_layers(c, "language_model."),
    "deepseek_v4": lambda c: list(deepseek_v4_layout.mtp_layout(c).specs),
}


def mtp_specs(hf: dict, cfg) -> list[TensorSpec]:
    """The tensors of the multi-token-prediction layers of config `hf` (parsed: `cfg`), none without."""
    own = MTP_LAYERS.get(cfg.family)
    if own is not None:
        return own(cfg)
    return list(mtp_layout(hf).specs) if cfg.num_nextn_predict_layers else []


def make_tiny(
    family: str,
    out: str,
    *,
    seed: int = 0,
    shards: int = 1,
    dtype: str = "bf16",
    overwrite: bool = False,
    source_format: str | None = None,
    fused_experts: bool | None = None,
    **overrides,
) -> str:
    """Write a random checkpoint of `family` (config from eprt/configs/tiny, `overrides` on top) to `out`.

    source_format stores it as the checkpoints users hold (SOURCE_FORMATS): "int4" (Kimi-K2-Thinking's
    INT4 routed experts), "mxfp4" (Kimi-K3's MXFP4 experts), "mxfp4-blocks" (GPT-OSS's) or "fp8-block"
    (DeepSeek-V3).
    fused_experts stores each layer's routed experts as Qwen3.5-MoE is released (and as transformers
    5's MoE modules hold them): `experts.gate_up_proj` [E, 2I, D] and `experts.down_proj` [E, D, I],
    in the storage the family's layout names (Llama-4's transposed); None: as the family's
    releases store them (`RELEASES`)."""
    release = RELEASES.get(family, PLAIN)
    if fused_experts is None:
        fused_experts = release.fused_experts
    hf = tiny_config(family, **overrides)
    hf["torch_dtype"] = WEIGHT_DTYPE_NAMES[dtype]
    cfg = parse_hf_config(hf, f"tiny {family}")
    fam = reader_for(cfg.model_type, "tiny")
    layout = fam.layout(cfg)
    specs = list(layout.specs)
    specs += mtp_specs(hf, cfg)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for spec in specs:
        if fused_experts and spec.fused:
            tensors[spec.fused] = init(spec.fused, spec.fused_shape(), g).to(WEIGHT_DTYPES[dtype])
            continue
        for src in (spec.alias,) if spec.alias and release.flat_names else spec.sources:
            if spec.table:
                tensors[src] = expert_table(spec.shape, cfg.num_experts, g)
                continue
            t = init(src, released_shape(spec), g)
            tensors[src] = t if stored_fp32(fam, src) else t.to(WEIGHT_DTYPES[dtype])
    if "vision_config" in hf:
        tensors.update(
            {n: t.to(WEIGHT_DTYPES[dtype]) for n, t in vision_tensors(cfg.hidden_size, g, cfg.model_type).items()}
        )
    if source_format == DEEPSEEK_V4:
        hf["quantization_config"], hf["expert_dtype"] = SOURCE_FORMATS[source_format], "fp4"
        tensors = encode_deepseek_v4(tensors)
    elif source_format:
        hf["quantization_config"] = SOURCE_FORMATS[source_format]
        if hf["quantization_config"]["quant_method"] == "mxfp4":
            tensors = encode_mxfp4_blocks(tensors, specs)
        else:
            tensors = encode_source(tensors, hf["quantization_config"])
    names = list(tensors)
    with atomic_output_dir(out, overwrite=overwrite, inputs=(TINY_DIR,)) as tmp:
        if shards == 1:
            write_file(os.path.join(tmp, SINGLE), save(tensors, metadata={"format": "pt"}))
        else:
            weight_map = {}
            per = -(-len(names) // shards)
            for i in range(shards):
                fname = shard_name(i, shards)
                part = {n: tensors[n] for n in names[i * per : (i + 1) * per]}
                write_file(os.path.join(tmp, fname), save(part, metadata={"format": "pt"}))
                weight_map.update({n: fname for n in part})
            write_index(tmp, weight_map, sum(t.numel() * t.element_size() for t in tensors.values()))
        write_json(os.path.join(tmp, CONFIG), hf)
        copy_files(TINY_DIR, TOKENIZER_FILES, tmp)
    return out


# --- compressed and FP8 sources ----------------------------------------------------------------
# The quantization_config each ships, as on the Hugging Face Hub.
_GROUP32 = {
    "actorder": None,
    "block_structure": None,
    "dynamic": False,
    "group_size": 32,
    "num_bits": 4,
    "observer": "minmax",
    "observer_kwargs": {},
    "strategy": "group",
    "symmetric": True,
}
DEEPSEEK_V4 = "deepseek-v4"
SOURCE_FORMATS = {
    "int4": {  # Kimi-K2-Thinking, K2.5
        "config_groups": {
            "group_0": {
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {**_GROUP32, "type": "int"},
            }
        },
        "format": "pack-quantized",
        "ignore": [
            "lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
        ],  # K2.5's vision tower and projector stay bf16
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    },
    "mxfp4": {  # Kimi-K3
        "config_groups": {
            "group_0": {
                "format": "mxfp4-pack-quantized",
                "input_activations": None,
                "output_activations": None,
                "targets": ["Linear"],
                "weights": {**_GROUP32, "type": "float", "scale_dtype": "torch.uint8", "zp_dtype": None},
            }
        },
        "format": "mxfp4-pack-quantized",
        "global_compression_ratio": None,
        "ignore": [
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
            "re:.*lm_head.*",
            "re:.*vision_tower.*",
            "re:.*mm_projector.*",
            # K3's latent projections and attention-residual projections stay unquantized
            "re:.*routed_expert_(down|up)_proj.*",
            "re:.*_res_proj.*",
        ],
        "kv_cache_scheme": None,
        "quant_method": "compressed-tensors",
        "quantization_status": "compressed",
    },
    "fp8-block": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",  # DeepSeek-V3
        "weight_block_size": [128, 128],
    },
    "fp8-tensor": {  # Mistral-Small-4: one scale per weight, static activation scales
        "activation_scheme": "static",
        "quant_method": "fp8",
        "weight_block_size": None,
    },
    # GPT-OSS: its routed experts' weights in OpenAI's MXFP4 (eprt.storage.mxfp4_blocks)
    "mxfp4-blocks": RELEASE_QUANTIZATION_CONFIG,
    "mxfp8": {  # MiniMax-M3: blocks of 1x32, each scale an E8M0 exponent (weight_scale_inv uint8)
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [1, 32],
    },
    DEEPSEEK_V4: {  # DeepSeek-V4: the dense Linears FP8, the routed experts FP4, every scale E8M0 (`.scale`)
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
}


@dataclass(frozen=True)
class Release:
    """How a family's releases store its tensors, where not as the plain tiny checkpoint does (each
    expert apart, the layout's names, the checkpoint's dtype). make_tiny writes a family's names and
    expert storage so unless told otherwise; `released` adds the encoding (what eprt-make-tiny writes)."""

    fused_experts: bool = False  # each layer's routed experts one tensor per projection, in the layout's storage
    flat_names: bool = False  # plain tensors under the layout's `alias` (DeepSeek-V4's own names)
    source_format: str | None = None  # the weights encoded as this SOURCE_FORMATS entry says
    # experts fused only in the encoded release: the plain tiny checkpoint keeps the per-expert form its
    # first tests had (as Qwen3.5-MoE's, fused in its release too, keeps it always)
    encoded_fused: bool = False


RELEASES = {
    "llama4": Release(fused_experts=True),
    "llama4_text": Release(fused_experts=True),
    "gpt_oss": Release(fused_experts=True, source_format="mxfp4-blocks"),
    "mistral4": Release(source_format="fp8-tensor", encoded_fused=True),  # per-tensor FP8, its experts fused
    "mistral4_vlm": Release(source_format="fp8-tensor", encoded_fused=True),
    "deepseek_v4": Release(flat_names=True, source_format=DEEPSEEK_V4),
}
PLAIN = Release()


def released(family: str) -> dict:
    """make_tiny's keywords that store `family` as its release does (`eprt-make-tiny`'s checkpoint)."""
    release = RELEASES.get(family, PLAIN)
    return {"source_format": release.source_format, "fused_experts": release.fused_experts or release.encoded_fused}


# Not Linears (embeddings, the router), so never compressed; DeepSeek-V3 also keeps its heads in bf16,
# DeepSeek-V3.2 its indexer's weights_proj, MiniMax-M3's MXFP8 release its vision tower and projectors.
_NOT_LINEAR = re.compile(r".*(embed_tokens|\.(mlp|block_sparse_moe)\.gate)")
_FP8_KEPT = re.compile(
    r".*(embed_tokens|\.(mlp|block_sparse_moe)\.gate|lm_head|shared_head\.head|indexer\.weights_proj)"
    r"|(vision_tower|multi_modal_projector|patch_merge_mlp)\..*"  # the releases keep their vision towers in bf16
)


def encode_source(tensors: dict[str, torch.Tensor], qc: dict) -> dict[str, torch.Tensor]:
    """The tensors as a checkpoint quantized by `qc` stores them: each Linear weight `M.weight`
    it covers replaced by its compressed or FP8 tensors (per-tensor FP8: fused experts too)."""
    out = {}
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        per_tensor = qc["quant_method"] == "fp8" and not qc.get("weight_block_size")
        if per_tensor and (
            name.endswith((".experts.gate_up_proj", ".experts.down_proj"))
            or (name.endswith(".weight") and t.dim() == 2 and not _FP8_KEPT.fullmatch(module))
        ):
            parts = quantize_tensor_fp8(t, halves=name.endswith("gate_up_proj"))
            out.update({source: parts[c] for c, source in component_names(name, parts).items()})
        elif not name.endswith(".weight") or t.dim() != 2:
            out[name] = t
        elif qc["quant_method"] == "fp8" and not _FP8_KEPT.fullmatch(module):
            e8m0 = qc.get("scale_fmt") == "ue8m0"
            out[name], out[f"{module}.weight_scale_inv"] = quantize_block_fp8(t, tuple(qc["weight_block_size"]), e8m0)
        elif qc["quant_method"] != "fp8" and not _NOT_LINEAR.fullmatch(module) and not matches(module, qc["ignore"]):
            out.update({f"{module}.{c}": v for c, v in compress_weight(t, qc).items()})
        else:
            out[name] = t
    return out


def release_mxfp4_scales(w: torch.Tensor) -> torch.Tensor:
    """E8M0 scales of the tiny MXFP4 sources (GPT-OSS's experts, DeepSeek-V4's): 2^ceil(log2(amax / 6)),
    nothing clipped; a source's own encoding, apart from the rule of eprt's MXFP4 export."""
    return checked_scales(w, E2M1_MAX)


def encode_mxfp4_blocks(tensors: dict[str, torch.Tensor], specs: list[TensorSpec]) -> dict[str, torch.Tensor]:
    """The tensors with each fused routed-expert weight P stored as GPT-OSS's release stores it:
    `P_blocks` [E, out, in/32, 16] and `P_scales` [E, out, in/32] (eprt.storage.mxfp4_blocks), its
    rows the outputs in the fused tensor's own order (gate and up interleaved); biases as they are."""
    out = dict(tensors)
    for spec in specs:
        if not (spec.stacked and spec.fused in tensors and spec.name.rsplit(".", 1)[1] in EXPERT_LEAVES):
            continue
        t = out.pop(spec.fused)
        w = (t.transpose(-2, -1) if spec.transposed else t).float().contiguous()
        scales = release_mxfp4_scales(w)
        out[f"{spec.fused}_blocks"] = quantize_mxfp4(w, scales).view(*w.shape[:-1], -1, 16)
        out[f"{spec.fused}_scales"] = scales
    return out


# DeepSeek-V4's release: the Linears it keeps in bf16 (embedding, head, router, the grouped output
# projection's first half, the compressors' projections, the indexer's head weights), its FP4 routed experts
_DEEPSEEK_V4_BF16 = re.compile(r"embed|head|.*\.ffn\.gate|.*\.attn\.wo_a|.*\.compressor\.(wkv|wgate)|.*\.weights_proj")
_DEEPSEEK_V4_FP4 = re.compile(r".*\.ffn\.experts\.\d+\.w[123]")


def encode_deepseek_v4(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as DeepSeek-V4's release stores them: each Linear weight `M.weight` it quantizes
    replaced by its codes and its E8M0 `M.scale` (eprt.storage.deepseek_encodings)."""
    out = {}
    for name, t in tensors.items():
        module = name[: -len(".weight")]
        if not name.endswith(".weight") or t.dim() != 2 or _DEEPSEEK_V4_BF16.fullmatch(module):
            out[name] = t
            continue
        if _DEEPSEEK_V4_FP4.fullmatch(module):  # MXFP4's codes and scales, in the release's dtypes
            scales = release_mxfp4_scales(t.float())
            out[name] = quantize_mxfp4(t.float(), scales).view(torch.int8)
            out[f"{module}.scale"] = scales.view(torch.float8_e8m0fnu)
        else:
            out[name], exponents = quantize_block_fp8(t, (128, 128), e8m0=True)
            out[f"{module}.scale"] = exponents.view(torch.float8_e8m0fnu)
    return out


def compress_weight(weight: torch.Tensor, qc: dict, group: str = "group_0") -> dict[str, torch.Tensor]:
    """One Linear weight compressed by the compressed-tensors library under config group `group`
    of `qc`, with the library's own min-max scales (group strategy, as Kimi's checkpoints)."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    g = qc["config_groups"][group]
    scheme = QuantizationScheme.model_validate(g)
    rows, cols = weight.shape
    blocks = weight.reshape(rows, cols // scheme.weights.group_size, scheme.weights.group_size)
    scale, zero = calculate_qparams(blocks.amin(-1), blocks.amax(-1), scheme.weights)
    c = BaseCompressor.get_value_from_registry(g.get("format") or qc["format"]).compress(
        {"weight": weight, "weight_scale": scale, "weight_zero_point": zero}, scheme
    )
    if "weight_shape" in c:  # the library writes int64; Kimi's checkpoints hold int32
        c["weight_shape"] = c["weight_shape"].to(torch.int32)
    return {k: v.contiguous() for k, v in c.items()}


def quantize_tensor_fp8(weight: torch.Tensor, halves: bool = False) -> dict[str, torch.Tensor]:
    """Per-tensor FP8 as Mistral-Small-4 stores it: e4m3 values, an fp32 weight_scale_inv (amax / 448)
    and the static activation_scale of its inputs, scalars for a Linear; for fused experts [E, ...]
    one per expert ([E, 1, 1]; with `halves`, [E, 2, 1]: the gate rows' and the up rows' of each,
    as transformers allocates them) and the activation scales [E]."""
    w = weight.float()
    if w.dim() == 2:
        scale = (w.abs().amax() / 448.0).clamp(min=1e-12)
        return {
            "weight": (w / scale).to(torch.float8_e4m3fn),
            "weight_scale_inv": scale,
            "activation_scale": scale * 10,
        }
    E, rows, cols = w.shape
    n = 2 if halves else 1
    spans = w.view(E, n, rows // n, cols)
    scale = (spans.abs().amax((2, 3)) / 448.0).clamp(min=1e-12)[:, :, None]
    q = (spans / scale[..., None]).to(torch.float8_e4m3fn).view(E, rows, cols)
    return {"weight": q, "weight_scale_inv": scale, "activation_scale": torch.linspace(0.01, 0.02, E)}


def quantize_block_fp8(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128), e8m0: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's block FP8: e4m3 values and an fp32 weight_scale_inv (block amax / 448) per block;
    with `e8m0` (MXFP8), that scale rounded up to a power of two, stored as its E8M0 exponent (uint8)."""
    (rows, cols), (bo, bi) = weight.shape, block
    w = weight.float()
    padded = torch.nn.functional.pad(w.abs(), (0, -cols % bi, 0, -rows % bo))
    amax = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi).amax((1, 3))
    scale = (amax / 448.0).clamp(min=1e-12)
    if e8m0:
        exponent = torch.ceil(torch.log2(scale))
        scale, stored = torch.exp2(exponent), (exponent + 127).to(torch.uint8)
    else:
        stored = scale
    return (w / expand_blocks(scale, (rows, cols), block)).to(torch.float8_e4m3fn), stored
