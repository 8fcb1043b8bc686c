"""GLM-4.5 / 4.6 (`glm4_moe`): logits equal transformers' Glm4MoeForCausalLM (fp32) with every
feature on and off (partial rotary, q/k norm, biases, expert groups, dense first layers), from
either spelling of the config; expert-parallel logits equal the single-process ones; a PTQ export
is the same bytes at every (world, ep)."""

import pytest
import torch

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM  # noqa: E402

from eprt.families import model_class, parse_hf_config, reader_for  # noqa: E402
from tests.ep_checks import assert_ep_logits, assert_exports_layout_invariant, tiny_checkpoints  # noqa: E402
from tests.oracles.test_models import (
    TINY,
    YARN,
    assert_groups_and_bias_matter,
    assert_matches_transformers,
    build,
)  # noqa: E402

FAMILY = "glm4_moe"


def glm(**kw) -> Glm4MoeConfig:
    base = dict(
        TINY,
        num_hidden_layers=3,
        num_key_value_heads=2,
        head_dim=16,
        n_routed_experts=8,
        n_shared_experts=1,
        n_group=4,
        topk_group=2,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        use_qk_norm=True,
        attention_bias=True,
        initializer_range=0.1,
    )
    return Glm4MoeConfig(**{**base, **kw})


CASES = {
    "groups_qk_norm_bias_half_rotary": dict(),
    "no_qk_norm_no_bias_quarter_rotary_yarn": dict(
        use_qk_norm=False,
        attention_bias=False,
        partial_rotary_factor=0.25,
        rope_parameters={**YARN, "partial_rotary_factor": 0.25},
    ),
    "full_rotary_two_shared_all_moe_tied": dict(
        partial_rotary_factor=1.0,
        n_shared_experts=2,
        first_k_dense_replace=0,
        n_group=1,
        topk_group=1,
        tie_word_embeddings=True,
        norm_topk_prob=False,
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_glm4_moe_logits(tmp_path, case):
    cfg = glm(**CASES[case])
    em, _ = assert_matches_transformers(tmp_path, build(cfg, cls=Glm4MoeForCausalLM))
    c = em.config
    assert c.gqa.rotary_dim == int(16 * cfg.rope_parameters["partial_rotary_factor"])
    assert c.gqa.qk_norm == cfg.use_qk_norm and c.gqa.qkv_bias == cfg.attention_bias
    assert [i for i, _ in em.moe_blocks()] == list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    assert_groups_and_bias_matter(em, cfg)


def test_the_transformers_4_spelling_reads_the_same(tmp_path):
    """Released GLM-4.5 configs put partial_rotary_factor and rope_theta on the top level and say
    num_nextn_predict_layers; transformers 5 writes rope_parameters and may say num_mtp_layers."""
    v5 = glm(
        partial_rotary_factor=0.25,
        rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25},
    ).to_dict()
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "num_nextn_predict_layers")}
    v4.update(rope_theta=5000.0, partial_rotary_factor=0.25, rope_scaling=None, num_nextn_predict_layers=1)
    v5_mtp = {**{k: v for k, v in v5.items() if k != "num_nextn_predict_layers"}, "num_mtp_layers": 1}
    a, b, c = (parse_hf_config(d) for d in (v5, v4, v5_mtp))
    assert a == b == c
    assert a.gqa.rotary_dim == 4 and a.rope.theta == 5000.0 and a.num_nextn_predict_layers == 1


def test_a_rotary_width_that_cannot_rotate_is_refused():
    with pytest.raises(Exception, match="partial_rotary_factor"):
        parse_hf_config({**glm().to_dict(), "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.1}})


@pytest.mark.parametrize("qk_norm", [True, False])
def test_parameter_names_are_the_layout_names(qk_norm):
    c = parse_hf_config(glm(use_qk_norm=qk_norm).to_dict())
    with torch.device("meta"):
        model = model_class(c)(c)
    want = {s.name: s.shape for s in reader_for(c.model_type, "test").layout(c).specs}
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == want
    assert any(n.endswith("q_proj.bias") for n in want) and not any(n.endswith("o_proj.bias") for n in want)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp(FAMILY), FAMILY)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_equal_single_process(tiny, world, ep):
    assert_ep_logits([tiny["fp32"][1]], world, ep)


@pytest.mark.timeout(400)
def test_ptq_exports_are_the_same_bytes_at_every_layout(tiny, tmp_path):
    hf, ck = tiny["bf16"]
    assert_exports_layout_invariant(ck, hf, str(tmp_path))
