"""GLM-5 (`glm_moe_dsa`): logits equal transformers' GlmMoeDsaForCausalLM (fp32) with the indexer's
interleaved RoPE and index sharing (layers marked "shared" reuse the last full layer's top-k) in
every spelling of the marks, on sequences longer than index_topk (ties among the index scores to
the lowest position, as DeepSeek's reference); the layout has no indexer in a shared layer.
Expert-parallel logits and PTQ exports at every (world, ep), the block-FP8 source: with
DeepSeek-V3.2's, in tests/oracles/test_deepseek_v32.py."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import GlmMoeDsaConfig, GlmMoeDsaForCausalLM  # noqa: E402

import eprt  # noqa: E402
from eprt.errors import ConfigError  # noqa: E402
from eprt.families import model_class, parse_hf_config, reader_for  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.loading.resolved import ResolvedCheckpoint  # noqa: E402
from eprt.models.rope import rope_rotate_half  # noqa: E402
from eprt.quant.run.memory_plan import RunShape  # noqa: E402
from eprt.quant.run.planner import Planner  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.oracles.test_deepseek_v32 import keys_chosen_differently  # noqa: E402
from tests.oracles.test_deepseek_v32 import logits_with_ties_to_the_lowest_position as with_lowest_ties  # noqa: E402
from tests.oracles.test_models import DEEPSEEK, YARN, assert_groups_and_bias_matter, build, to_eprt, tokens  # noqa: E402


def glm(**kw) -> GlmMoeDsaConfig:
    base = dict(DEEPSEEK, num_hidden_layers=5, index_n_heads=4, index_head_dim=16, index_topk=4)
    return GlmMoeDsaConfig(**{**base, **kw})


# (config, tokens): a full layer after shared ones, shared after shared, dense and MoE layers of
# each mark; the index heads wider than the rotated dims (a pass-through part)
CASES = {
    "pattern_yarn_groups": (dict(index_topk_pattern="FSSFS", rope_parameters=YARN), 13),
    "freq_offset_two_dense": (dict(index_topk_freq=2, index_skip_topk_offset=2, first_k_dense_replace=2), 11),
    "listed_top8_tied": (
        dict(
            indexer_types=["full", "shared", "full", "shared", "shared"],
            index_topk=8,
            index_n_heads=2,
            tie_word_embeddings=True,
            n_group=1,
            topk_group=1,
        ),
        21,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_glm_moe_dsa_logits(tmp_path, case):
    overrides, T = CASES[case]
    cfg = glm(initializer_range=0.02, **overrides)
    m = build(cfg, cls=GlmMoeDsaForCausalLM)
    em = eprt.load_model(to_eprt(tmp_path, m), dtype=torch.float32)
    assert [layer.self_attn.indexer is None for layer in em.model.layers] == [t == "shared" for t in cfg.indexer_types]
    ids = tokens(2, T)
    want, index_scores = with_lowest_ties(m, ids)
    with torch.no_grad():
        got = em(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    keys_chosen_differently(index_scores)  # transformers' own topk differs only among tied keys
    assert len(index_scores) == cfg.indexer_types.count("full")
    if cfg.n_group > 1:
        assert_groups_and_bias_matter(em, cfg)


def test_sharing_and_the_interleaved_rope_change_the_logits(tmp_path):
    """The shared layers' reuse of the full layer's keys, and the indexer's interleaved RoPE, each
    move the logits: a model whose shared layers attend to every key, or whose indexer rotates
    half-split (DeepSeek-V3.2's), gives other logits."""
    cfg = glm(initializer_range=0.02, index_topk_pattern="FSSFS")
    m = build(cfg, cls=GlmMoeDsaForCausalLM)
    ids = tokens(2, 13)
    want, _ = with_lowest_ties(m, ids)
    ck = to_eprt(tmp_path, m)

    half_split = eprt.load_model(ck, dtype=torch.float32)
    for layer in half_split.model.layers:
        if layer.self_attn.indexer is not None:
            layer.self_attn.indexer.rope = rope_rotate_half
    dense_shared = eprt.load_model(ck, dtype=torch.float32)
    for layer in dense_shared.model.layers:
        if layer.self_attn.indexer is None:
            layer.self_attn.forward = lambda x, cos, sin, carried, _attend=layer.self_attn.forward: _attend(x, cos, sin)
    with torch.no_grad():
        torch.testing.assert_close(eprt.load_model(ck, dtype=torch.float32)(ids), want, rtol=1e-4, atol=1e-5)
        for variant in (half_split, dense_shared):
            assert not torch.allclose(variant(ids), want, rtol=1e-3, atol=1e-3)


def test_the_marks_in_every_spelling_read_the_same():
    """indexer_types, index_topk_pattern and the freq/offset schedule give the same shared layers
    as transformers derives; transformers 5 writes indexer_types."""
    by_pattern = parse_hf_config({**glm(index_topk_pattern="FSFSS").to_dict(), "indexer_types": None})
    listed = parse_hf_config(glm(indexer_types=["full", "shared", "full", "shared", "shared"]).to_dict())
    assert by_pattern.own == listed.own and listed.own.shared_index_layers == (1, 3, 4)
    schedule = {**glm().to_dict(), "indexer_types": None, "index_topk_freq": 2, "index_skip_topk_offset": 2}
    want = [i for i, t in enumerate(glm(index_topk_freq=2, index_skip_topk_offset=2).indexer_types) if t == "shared"]
    assert parse_hf_config(schedule).own.shared_index_layers == tuple(want) == (2, 4)
    assert parse_hf_config({**glm().to_dict(), "indexer_types": None}).own.shared_index_layers == ()


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"indexer_types": ["shared", "full", "full", "full", "full"]}, "layer 0 is marked 'shared'"),
        ({"indexer_types": ["full", "sparse", "full", "full", "full"]}, "indexer_types"),
        ({"indexer_types": ["full"]}, "each of the 5 layers"),
        ({"indexer_types": None, "index_topk_pattern": "FSX"}, "index_topk_pattern"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"indexer_rope_interleave": False}, "indexer_rope_interleave is false"),
        ({"indexer_types": [{}]}, "'indexer_types' is .{}.; it must be a JSON list of layer kinds"),
        ({"indexer_types": None, "index_topk_freq": "2"}, "'index_topk_freq' is '2' .str.; it must be an integer"),
        ({"indexer_types": None, "index_topk_pattern": "F" * 5000}, "lists 5000 layers, over the 4096"),
    ],
)
def test_marks_eprt_cannot_run_are_refused_by_name(bad, message):
    with pytest.raises(ConfigError, match=message):
        parse_hf_config({**glm().to_dict(), **bad})


def test_parameter_names_are_the_layout_names():
    c = parse_hf_config(glm(index_topk_pattern="FSSFS").to_dict())
    with torch.device("meta"):
        model = model_class(c)(c)
    layout = reader_for(c.model_type, "test").layout(c)
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == {s.name: s.shape for s in layout.specs}
    with_indexer = {s.name.split(".")[2] for s in layout.specs if ".indexer." in s.name}
    assert with_indexer == {"0", "3"}
    assert not any(".indexer." in m for m in layout.linear_modules())


def test_the_memory_plan_counts_the_top_k_each_sequence_carries(tmp_path):
    """Where a layer shares the top-k, each sequence a rank holds carries 3 x T x T bytes beside its
    hidden states (the last full layer's pick, the new one per sequence, the two joined); where
    no layer shares, nothing."""
    shape = RunShape(1, 4, 2, num_sequences=64, seq_len=24, step_sequences=8, group_tokens=48)
    hidden = {}
    for freq, shares in ((2, True), (1, False)):
        hf = make_tiny("glm_moe_dsa", str(tmp_path / f"hf{freq}"), index_topk_freq=freq)
        with Checkpoint(convert_hf(hf, str(tmp_path / f"ck{freq}"), progress=False)) as ck:
            assert bool(ck.config.own.shared_index_layers) == shares
            planner = Planner.of(ResolvedCheckpoint.of(ck, torch.float32), torch.device("cpu"))
            hidden[shares] = planner.plan(shape, 0).hidden
    assert hidden[True] - hidden[False] == 16 * 3 * 24 * 24  # rank 1 of 4 holds 16 of the 64 sequences
