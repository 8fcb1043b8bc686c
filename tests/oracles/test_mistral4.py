"""Mistral-Small-4 (`mistral4`): logits equal transformers' Mistral4ForCausalLM (fp32) with every
piece on and off (Llama-4's query temperature, YaRN, expert groups, dense first layers, low-rank
q, shared experts, tied head), from the config as transformers writes it and with no rope
parameters at all, and as released, inside Mistral3ForConditionalGeneration (`mistral4_vlm`);
expert-parallel logits equal the single-process ones; a PTQ export is the same bytes at every
(world, ep)."""

import dataclasses

import pytest
import torch

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import Mistral3Config, Mistral3ForConditionalGeneration, Mistral4Config, Mistral4ForCausalLM  # noqa: E402

from eprt.errors import ConfigError  # noqa: E402
from eprt.families import (  # noqa: E402
    model_class,  # noqa: E402
    parse_hf_config,
    reader_for,
)
from eprt.testing.tiny import tiny_config  # noqa: E402
from tests.ep_checks import assert_ep_logits, assert_exports_layout_invariant, tiny_checkpoints  # noqa: E402
from tests.oracles.test_models import DEEPSEEK, assert_matches_transformers, build, tokens  # noqa: E402

FAMILY = "mistral4"
# YaRN as the release sets it, at a span the test's 12 tokens cross: the temperature grows past 4
ROPE = {
    "type": "yarn",
    "rope_theta": 10000.0,
    "factor": 16.0,
    "original_max_position_embeddings": 4,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "mscale_all_dim": 1.0,
    "mscale": 1.0,
    "llama_4_scaling_beta": 0.1,
}


def mistral(**kw) -> Mistral4Config:
    base = {k: v for k, v in DEEPSEEK.items()}
    base.update(routed_scaling_factor=1.5, rope_parameters=ROPE, max_position_embeddings=64)
    return Mistral4Config(**{**base, **kw})


CASES = {
    "groups_dense_first_temperature": dict(),
    "strong_temperature_ungrouped_all_moe_tied": dict(
        rope_parameters={**ROPE, "llama_4_scaling_beta": 0.7, "original_max_position_embeddings": 2},
        n_group=1,
        topk_group=1,
        first_k_dense_replace=0,
        n_shared_experts=2,
        tie_word_embeddings=True,
        norm_topk_prob=False,
    ),
    "no_low_rank_q_three_groups_of_two": dict(q_lora_rank=None, n_routed_experts=6, n_group=3, topk_group=2),
}


@pytest.mark.parametrize("case", CASES)
def test_mistral4_logits(tmp_path, case):
    cfg = mistral(**CASES[case])
    m = build(cfg, cls=Mistral4ForCausalLM)
    em, want = assert_matches_transformers(tmp_path, m)
    c = em.config
    beta = cfg.rope_parameters["llama_4_scaling_beta"]
    assert c.own.temperature_beta == beta
    assert c.own.temperature_positions == cfg.rope_parameters["original_max_position_embeddings"]
    assert [i for i, _ in em.moe_blocks()] == list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    # the temperature is part of what matched: without it the logits move far beyond the tolerance
    for layer in em.model.layers:
        layer.self_attn.query_temperature = None
    with torch.no_grad():
        assert not torch.allclose(em(tokens()), want, rtol=1e-3, atol=1e-3)


def test_expert_groups_change_the_routing(tmp_path):
    """On the tokens the test runs, the group limit changes which experts some token gets, so the
    match above covers the grouped choice and not only the plain top-k."""
    grouped = mistral(n_group=4, topk_group=1)
    m = build(grouped, cls=Mistral4ForCausalLM)
    em, want = assert_matches_transformers(tmp_path, m)
    for _, block in em.moe_blocks():
        block.gate.n_group = block.gate.topk_group = 1
    with torch.no_grad():
        assert not torch.allclose(em(tokens()), want, rtol=1e-3, atol=1e-3)


def test_the_release_inside_mistral3_gives_the_language_models_logits(tmp_path):
    """The release wraps the language model in Mistral3's vision-language model: eprt reads it under
    `language_model.`, carries the vision tower, and gives the wrapper's text-only logits."""
    vlm = tiny_config("mistral4_vlm")
    cfg = Mistral3Config(**{k: v for k, v in vlm.items() if k not in ("model_type", "torch_dtype")})
    cfg.text_config = mistral(**CASES["groups_dense_first_temperature"])
    torch.manual_seed(0)
    m = Mistral3ForConditionalGeneration(cfg).float().eval()
    with torch.no_grad():
        for layer in m.model.language_model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.weight.normal_(0, 0.3)
    em, _ = assert_matches_transformers(tmp_path, m)
    assert em.config.family == "mistral4_vlm" and em.decoder()[0] == "language_model.model."
    assert em.config.own.temperature_beta == ROPE["llama_4_scaling_beta"]


def test_a_mistral3_checkpoint_around_another_language_model_is_refused():
    dense = {**tiny_config("mistral4_vlm"), "text_config": {"model_type": "mistral", "hidden_size": 64}}
    with pytest.raises(ConfigError, match="text_config.model_type is 'mistral': eprt reads the mistral3 checkpoints"):
        parse_hf_config(dense)


def test_no_rope_parameters_reads_the_reference_defaults():
    """transformers fills in the release's YaRN and temperature where config.json has no rope
    parameters; eprt reads the same."""
    hf = {k: v for k, v in mistral().to_dict().items() if k not in ("rope_parameters", "rope_scaling")}
    c = parse_hf_config(hf)
    ref = Mistral4Config(**{k: v for k, v in hf.items() if k != "model_type"}).rope_parameters
    assert c.rope.theta == ref["rope_theta"] and c.rope.yarn.factor == ref["factor"]
    assert c.rope.yarn.original_max_position_embeddings == ref["original_max_position_embeddings"]
    assert (c.own.temperature_beta, c.own.temperature_positions) == (0.1, 8192)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"attention_bias": True}, "attention_bias"),
        ({"rope_interleave": False}, "rope_interleave"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"n_group": 3}, "n_group"),
        ({"rope_parameters": {**ROPE, "llama_4_scaling_beta": None}}, "llama_4_scaling_beta"),
        ({"rope_parameters": {**ROPE, "llama_4_scaling_beta": "big"}}, "llama_4_scaling_beta"),
    ],
)
def test_what_eprt_cannot_run_is_refused_by_name(change, match):
    with pytest.raises(ConfigError, match=match):
        parse_hf_config({**mistral().to_dict(), **change})


def test_own_config_round_trips_through_the_manifest_json():
    c = parse_hf_config(tiny_config(FAMILY))
    assert type(c).from_json(c.to_json()) == c
    assert dataclasses.asdict(c.own) == {"temperature_beta": 0.1, "temperature_positions": 8}


@pytest.mark.parametrize("tied", [False, True])
def test_parameter_names_are_the_layout_names(tied):
    c = parse_hf_config(mistral(tie_word_embeddings=tied).to_dict())
    with torch.device("meta"):
        model = model_class(c)(c)
    want = {s.name: s.shape for s in reader_for(c.model_type, "test").layout(c).specs}
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == want
    assert ("lm_head.weight" in want) is not tied


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp(FAMILY), FAMILY)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_equal_single_process(tiny, world, ep):
    assert_ep_logits([tiny["fp32"][1]], world, ep, seq_len=12)


@pytest.mark.timeout(400)
def test_ptq_exports_are_the_same_bytes_at_every_layout(tiny, tmp_path):
    hf, ck = tiny["bf16"]
    assert_exports_layout_invariant(ck, hf, str(tmp_path))
