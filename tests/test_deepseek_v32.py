"""DeepSeek-V3.2 (`deepseek_v32`): logits equal transformers' DeepseekV32ForCausalLM (fp32) on
sequences longer than index_topk, where the lightning indexer masks keys, and shorter ones, where
it keeps every key; both config spellings; expert-parallel logits equal the single-process ones;
PTQ exports are the same bytes at every (world, ep), with the indexer unquantized and excluded."""

import json

import pytest
import torch
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM

import eprt
from eprt.families import parse_hf_config, reader_for
from eprt.hf.convert import convert_hf
from eprt.hf.check_export import check_export
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.ptq import PTQArgs, run_ptq
from eprt.models.registry import model_class
from eprt.testing.tiny import make_tiny
from tests.ep_checks import assert_ep_logits_bitwise, assert_exports_layout_invariant, tiny_checkpoints
from tests.hf_utils import raw, read_hf_tensors
from tests.test_compressed import FP8_DEEPSEEK, decompressed_copy, fp8_reference
from tests.test_roundtrip import assert_same_checkpoint
from tests.test_models import VOCAB, YARN, assert_groups_and_bias_matter, build, to_eprt, tokens

FAMILY = "deepseek_v32"
INDEXER = ("wq_b", "wk", "weights_proj")
LAYER0 = "model.layers.0.self_attn.indexer"


def v32(**kw) -> DeepseekV32Config:
    base = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                n_shared_experts=1, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16,
                v_head_dim=12, n_group=4, topk_group=2, first_k_dense_replace=1, initializer_range=0.1,
                max_position_embeddings=64, index_n_heads=8, index_head_dim=16, index_topk=4)
    return DeepseekV32Config(**{**base, **kw})


def spread_indexer(m) -> None:
    """Indexer weights large enough that its scores are far from ties (the default init is small)."""
    with torch.no_grad():
        for layer in m.model.layers:
            ix = layer.self_attn.indexer
            for lin in (ix.wq_b, ix.wk, ix.weights_proj):
                lin.weight.normal_(0, 0.5)
            ix.k_norm.bias.normal_(0, 0.1)


CASES = {
    "groups_yarn": dict(rope_parameters=YARN),
    "two_shared_all_moe_tied": dict(n_shared_experts=2, first_k_dense_replace=0, num_hidden_layers=2,
                                    tie_word_embeddings=True, norm_topk_prob=False, n_group=2, topk_group=1),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("T", [12, 4])
def test_deepseek_v32_logits(tmp_path, case, T):
    """T = 12 > index_topk = 4: the indexer masks all but 4 earlier keys from the later queries.
    T = 4: it keeps every key, and the model is DeepSeek-V3's MLA (calibration prompts no longer
    than index_topk run dense attention)."""
    cfg = v32(**CASES[case])
    m = build(cfg, cls=DeepseekV32ForCausalLM)
    spread_indexer(m)
    em = eprt.load_model(to_eprt(tmp_path, m), dtype=torch.float32)
    ids = tokens(2, T)
    indexers = [layer.self_attn.indexer for layer in em.model.layers]
    assert all(ix.topk == 4 and ix.n_heads == 8 for ix in indexers)
    with torch.no_grad():
        want, got = m(ids).logits, em(ids)
        for layer in em.model.layers:
            layer.self_attn.indexer = None
        dense = em(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    if T > cfg.index_topk:
        assert not torch.allclose(dense, want, rtol=1e-3, atol=1e-3)  # the mask changes the logits
    else:
        torch.testing.assert_close(dense, want, rtol=1e-4, atol=1e-5)
    assert [i for i, _ in em.moe_blocks()] == list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    if T > cfg.index_topk:
        assert_groups_and_bias_matter(eprt.load_model(str(tmp_path / "ck"), dtype=torch.float32), cfg)


def test_the_transformers_4_spelling_reads_the_same():
    """The released config says first_k_dense_replace, rope_theta and rope_scaling; transformers 5
    writes mlp_layer_types and rope_parameters as well."""
    v5 = v32(first_k_dense_replace=2, rope_parameters=YARN).to_dict()
    assert v5["mlp_layer_types"] == ["dense", "dense", "sparse"]
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "mlp_layer_types", "layer_types")}
    v4.update(rope_theta=YARN["rope_theta"], rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"})
    a, b = parse_hf_config(v5), parse_hf_config(v4)
    assert a == b and a.moe_layers == (2,) and a.indexer.topk == 4
    # transformers follows mlp_layer_types where it is written
    c = parse_hf_config({**v5, "mlp_layer_types": ["sparse", "dense", "sparse"]})
    assert c.moe_layers == (0, 2)


@pytest.mark.parametrize("bad, message", [({"q_lora_rank": None}, "q_lora_rank"),
                                          ({"index_head_dim": 4}, "index_head_dim"),
                                          ({"mlp_layer_types": ["dense"]}, "mlp_layer_types")])
def test_settings_eprt_cannot_run_are_refused_by_name(bad, message):
    with pytest.raises(Exception, match=message):
        parse_hf_config({**v32().to_dict(), **bad})


def test_parameter_names_are_the_layout_names():
    c = parse_hf_config(v32().to_dict())
    with torch.device("meta"):
        model = model_class(c.family)(c)
    layout = reader_for(c.model_type, "test").layout(c)
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == {s.name: s.shape for s in layout.specs}
    quantizable = layout.linear_modules()
    assert "model.layers.0.self_attn.q_b_proj" in quantizable
    assert not any(".indexer." in m for m in quantizable)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp(FAMILY), FAMILY)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_equal_single_process(tiny, world, ep):
    # 9 tokens, index_topk 4: the indexer masks
    assert_ep_logits_bitwise(tiny["fp32"][1], world, ep, seq_len=9)


@pytest.mark.timeout(400)
def test_ptq_exports_are_the_same_bytes_at_every_layout_and_keep_the_indexer(tiny, tmp_path):
    hf, ck = tiny["bf16"]
    refs = assert_exports_layout_invariant(ck, hf, str(tmp_path))
    source = read_hf_tensors(hf)
    for recipe, out in refs.items():
        excluded = json.load(open(f"{out}/hf_quant_config.json"))["quantization"]["exclude_modules"]
        exported = read_hf_tensors(out)
        for layer in range(3):
            for proj in INDEXER:
                module = f"model.layers.{layer}.self_attn.indexer.{proj}"
                assert any(module == e or (e.endswith("*") and module.startswith(e[:-1])) for e in excluded), \
                    (recipe, module)
                assert raw(exported[f"{module}.weight"]) == raw(source[f"{module}.weight"]), (recipe, module)
                assert f"{module}.weight_scale" not in exported and f"{module}.input_scale" not in exported
            assert f"model.layers.{layer}.self_attn.q_b_proj.weight_scale" in exported, recipe


def test_block_fp8_source_runs_decoded_and_exports_back(tmp_path):
    """DeepSeek-V3.2 ships block FP8 like DeepSeek-V3 (the indexer's wq_b and wk too, its weights_proj
    in bf16): it stays encoded, runs as if decoded ahead of time, exports back byte for byte; a
    quantized export writes the indexer decoded to bf16 and excluded, the way the engines load it."""
    hf = make_tiny(FAMILY, str(tmp_path / "fp8-hf"), source_format="fp8-block", **FP8_DEEPSEEK)
    source = read_hf_tensors(hf)
    assert f"{LAYER0}.wk.weight_scale_inv" in source and f"{LAYER0}.weights_proj.weight_scale_inv" not in source
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    plain = convert_hf(decompressed_copy(hf, str(tmp_path / "plain-hf"), torch.float32), str(tmp_path / "plain"),
                       progress=False)
    ids = torch.randint(0, 512, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(eprt.load_model(ck, dtype=torch.float32)(ids), eprt.load_model(plain, dtype=torch.float32)(ids))
    export_hf(ck, str(tmp_path / "out"), progress=False)
    assert_same_checkpoint(hf, str(tmp_path / "out"))

    run_ptq(ParallelState.single(), PTQArgs(ck, "nvfp4", str(tmp_path / "q"), calib_size=2, seq_len=16, batch_size=2,
                                            dtype="bf16", progress=False))
    out = export_hf(str(tmp_path / "q"), str(tmp_path / "x"), progress=False)
    assert check_export(out, hf) == []
    got, want = read_hf_tensors(out), fp8_reference(hf)
    for proj in ("wq_b", "wk"):
        name = f"{LAYER0}.{proj}.weight"
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want[name]), name
    assert raw(got[f"{LAYER0}.weights_proj.weight"]) == raw(source[f"{LAYER0}.weights_proj.weight"])
    assert got["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.uint8  # NVFP4 from the decoded weight
