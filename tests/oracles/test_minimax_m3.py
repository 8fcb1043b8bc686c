"""MiniMax-M3 against transformers on tiny random checkpoints, in float32: the language model saved
alone (transformers' names, `minimax_m3_vl_text`) and the vision-language checkpoint (the release's
names, `minimax_m3_vl`), with dense and MoE layers, sparse and full attention layers, partial RoPE
and a clamp that bites; the config in both spellings."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    MiniMaxM3SparseForConditionalGeneration,
    MiniMaxM3VLConfig,
    MiniMaxM3VLForCausalLM,
    MiniMaxM3VLTextConfig,
)

import eprt  # noqa: E402
from eprt.errors import ConfigError  # noqa: E402
from eprt.families import parse_hf_config  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.testing.tiny import make_tiny, tiny_config  # noqa: E402
from tests.hf_utils import raw, read_hf_tensors  # noqa: E402
from tests.oracles.test_models import TINY, VOCAB, assert_logits_and_carried  # noqa: E402
from tests.oracles.test_qwen_next_models import add_tensors  # noqa: E402

SPARSE, FULL = "minimax_m3_sparse", "full_attention"


def text_config(**kw) -> dict:
    base = dict(
        TINY,
        num_hidden_layers=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=16,
        dense_intermediate_size=40,
        shared_intermediate_size=24,
        num_local_experts=8,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=[FULL, SPARSE, FULL, SPARSE],
        index_n_heads=2,
        index_head_dim=16,
        index_block_size=4,
        index_topk_blocks=2,
        index_local_blocks=1,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        initializer_range=0.1,
    )
    return {**base, **kw}


def randomize(model) -> None:
    """Norm weights away from their zero init (they scale by 1 + weight), routers spread enough
    that routing does not hinge on near-ties, correction biases that change the choice."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.3)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0, 0.1)


TEXT_CASES = {
    # two indexer heads over four attention heads, blocks of 4, the best 2 of 6 blocks, half of each head rotated
    "blocks_of_4_top_2": (dict(), 23),
    # an indexer head per attention head, one kv head, blocks of 3, 3 best with 2 local, the whole head
    # rotated, a clamp of 0.05 on gate and up (the tiny activations pass it), a tied head
    "local_2_full_rotary_clamped": (
        dict(
            num_key_value_heads=1,
            index_n_heads=4,
            index_block_size=3,
            index_topk_blocks=3,
            index_local_blocks=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
            rotary_dim=16,
            swiglu_limit=0.05,
            swiglu_alpha=1.0,
            routed_scaling_factor=1.5,
            tie_word_embeddings=True,
        ),
        31,
    ),
    # every layer sparse and routed, one indexer head for both kv heads, fewer tokens than the blocks
    # the indexer may keep
    "all_sparse_short": (
        dict(mlp_layer_types=["sparse"] * 4, layer_types=[SPARSE] * 4, index_n_heads=1, index_topk_blocks=4),
        9,
    ),
}


@pytest.mark.parametrize("case", TEXT_CASES)
def test_minimax_m3_text_logits(case, tmp_path):
    kw, T = TEXT_CASES[case]
    torch.manual_seed(0)
    m = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**text_config(**kw))).eval()
    randomize(m)
    m.save_pretrained(tmp_path / "hf")
    moe = [i for i, t in enumerate(m.config.mlp_layer_types) if t == "sparse"]
    assert_logits_and_carried(tmp_path, m, "minimax_m3_vl_text", moe, T, ("model.",))


def test_the_indexer_changes_what_attention_sees(tmp_path):
    """With more blocks than it keeps, the indexer's choice moves the logits: eprt follows it, not full attention."""
    torch.manual_seed(0)
    sparse = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(**text_config())).eval()
    randomize(sparse)
    sparse.save_pretrained(tmp_path / "hf")
    em = eprt.load_model(convert_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), progress=False), dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for layer in em.model.layers:
            layer.self_attn.block_indexer = None
        dense = em(ids)
        assert (dense - sparse(input_ids=ids).logits).abs().max() > 1e-3


def test_minimax_m3_vlm_logits(tmp_path):
    """The vision-language checkpoint as transformers saves it (the release's names: block_sparse_moe,
    experts.E.w1/w2/w3, index_q_proj, the router's bias on the MoE block), its vision tower,
    projectors and MTP layers carried byte for byte."""
    torch.manual_seed(0)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    config = MiniMaxM3VLConfig(text_config=text_config(), vision_config=vision, projector_hidden_size=32)
    m = MiniMaxM3SparseForConditionalGeneration(config).eval()
    randomize(m)
    m.save_pretrained(tmp_path / "hf")
    # where the release keeps its multi-token-prediction layers, which transformers does not load
    add_tensors(
        tmp_path / "hf",
        {
            "language_model.model.mtp.layers.0.input_layernorm.weight": torch.randn(32),
            "language_model.model.mtp.fc.weight": torch.randn(32, 64),
        },
    )
    carried = ("vision_tower.", "multi_modal_projector.", "patch_merge_mlp.", "language_model.model.mtp.")
    assert_logits_and_carried(tmp_path, m, "minimax_m3_vl", [1, 2, 3], 23, carried)


def test_minimax_m3_configs():
    vlm, text = parse_hf_config(tiny_config("minimax_m3_vl")), parse_hf_config(tiny_config("minimax_m3_vl_text"))
    # the release's spelling (moe_layer_freq, sparse_attention_config) reads as transformers' does
    for c in (vlm, text):
        assert c.moe_layers == (1, 2, 3) and c.own.sparse_layers == (1, 3) and c.rotary_dim == 8
        assert (c.own.indexer.n_heads, c.own.indexer.block_size, c.own.indexer.topk_blocks) == (2, 4, 2)
        assert c.intermediate_size == 48 and c.moe.intermediate_size == 32 and c.own.shared_intermediate_size == 16
    assert not vlm.own.transformers_names and text.own.transformers_names
    # the factor (rope_parameters' or the top level's) wins over rotary_dim, which transformers writes
    # unread; without a factor, the release's rotary_dim; without either, the whole head
    assert parse_hf_config(tiny_config("minimax_m3_vl_text", rotary_dim=64)).rotary_dim == 8
    alone = {k: v for k, v in tiny_config("minimax_m3_vl_text").items() if k not in ("rope_parameters", "rotary_dim")}
    assert parse_hf_config({**alone, "rope_theta": 1e6, "partial_rotary_factor": 0.25}).rotary_dim == 4
    assert parse_hf_config({**alone, "rope_theta": 1e6, "rotary_dim": 4}).rotary_dim == 4
    assert parse_hf_config({**alone, "rope_theta": 1e6}).rotary_dim == 16
    with pytest.raises(ConfigError, match="rotary_dim 5 of head_dim 16: RoPE rotates an even count"):
        parse_hf_config({**alone, "rotary_dim": 5})
    with pytest.raises(ConfigError, match="index_n_heads 3 does not divide num_attention_heads 4"):
        parse_hf_config(tiny_config("minimax_m3_vl_text", index_n_heads=3))
    with pytest.raises(ConfigError, match="'index_local_blocks' is 0"):
        parse_hf_config(tiny_config("minimax_m3_vl_text", index_local_blocks=0))
    for field, value in [("scoring_func", "softmax"), ("use_routing_bias", False), ("use_gemma_norm", False)]:
        with pytest.raises(ConfigError, match=f"{field} is {value!r}; eprt runs MiniMax-M3 as released"):
            parse_hf_config(tiny_config("minimax_m3_vl_text", **{field: value}))
    # the release's sparse attention switches
    release = tiny_config("minimax_m3_vl")
    sparse = release["text_config"]["sparse_attention_config"]

    def with_sparse(**kw):
        return {**release, "text_config": {**release["text_config"], "sparse_attention_config": {**sparse, **kw}}}

    assert parse_hf_config(with_sparse(use_sparse_attention=False)).own.sparse_layers == ()
    with pytest.raises(ConfigError, match="sparse_score_type is 'mean'"):
        parse_hf_config(with_sparse(sparse_score_type="mean"))
    with pytest.raises(ConfigError, match="sparse_disable_index_value is not set on every sparse layer"):
        parse_hf_config(with_sparse(sparse_disable_index_value=[0, 1, 0, 0]))
    # the release's shared expert: n_shared_experts of intermediate_size where shared_intermediate_size is absent
    text = {k: v for k, v in tiny_config("minimax_m3_vl_text").items() if k != "shared_intermediate_size"}
    assert parse_hf_config({**text, "n_shared_experts": 2}).own.shared_intermediate_size == 64
    with pytest.raises(ConfigError, match="text_config"):
        parse_hf_config({"model_type": "minimax_m3_vl"})


def test_the_mxfp8_release_reads_as_stored(tmp_path):
    """MiniMax-M3 as the vendor ships it in MXFP8: each Linear's e4m3 `weight` with a `weight_scale_inv`
    of E8M0 exponents (uint8) per 1x32 block. The model reads w = fp8 * 2^(e - 127) (the OCP MX
    definition, rounded to bf16 as block FP8 is), and the unquantized export gives back every source
    tensor, encoded ones included, byte for byte."""
    hf = make_tiny("minimax_m3_vl", str(tmp_path / "hf"), source_format="mxfp8")
    source = read_hf_tensors(hf)
    encoded = sorted(n for n in source if n.endswith(".weight_scale_inv"))
    assert encoded and all(source[n].dtype == torch.uint8 for n in encoded)
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    model = eprt.load_model(ck, dtype=torch.float32)
    params = dict(model.named_parameters())
    assert any(n.replace("_scale_inv", "") in params for n in encoded)
    for scale in encoded:
        weight = scale[: -len("_scale_inv")]
        e = source[scale].float().repeat_interleave(32, dim=-1)[..., : source[weight].shape[-1]]
        want = (source[weight].float() * 2.0 ** (e - 127)).to(torch.bfloat16).float()
        if weight in params:  # the routed experts are stacked, the vision tower is carried
            assert torch.equal(params[weight], want), weight
    exported = read_hf_tensors(export_hf(ck, str(tmp_path / "out"), progress=False))
    assert set(exported) == set(source)
    assert all(exported[n].dtype == t.dtype and raw(exported[n]) == raw(t) for n, t in source.items())
