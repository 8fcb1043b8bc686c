"""Llama-4's config.json as the releases write it (Scout's and Maverick's text_config fields, transformers'
defaults where they leave one out), its MoE layers read as transformers reads them (the tiny
config's too), and the settings eprt cannot run refused by name."""

import json

import pytest

from eprt.config import ModelConfig
from eprt.errors import ConfigError
from eprt.families import parse_hf_config
from eprt.testing.tiny import tiny_config

TEXT = dict(
    model_type="llama4_text",
    hidden_size=5120,
    num_hidden_layers=48,
    num_attention_heads=40,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=8192,
    intermediate_size_mlp=16384,
    vocab_size=202048,
)
SCOUT = dict(
    TEXT,
    num_local_experts=16,
    interleave_moe_layer_step=1,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 16.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 1.0,
        "original_max_position_embeddings": 8192,
    },
)
MAVERICK = dict(TEXT, num_local_experts=128, interleave_moe_layer_step=2, use_qk_norm=False, rope_scaling=None)


def test_scout_and_maverick_as_released():
    scout, maverick = parse_hf_config(SCOUT), parse_hf_config(MAVERICK)
    every_fourth = tuple(i for i in range(48) if (i + 1) % 4)
    for c in (scout, maverick):
        assert c.own.rope_layers == c.own.chunked_layers == every_fourth
        assert (c.own.attention_chunk_size, c.own.floor_scale, c.own.attn_scale) == (8192, 8192.0, 0.1)
        assert c.rope.theta == 500000.0 and c.num_experts_per_tok == 1 and c.moe.num_shared_experts == 1
        assert (c.intermediate_size, c.moe.intermediate_size) == (16384, 8192)
        assert ModelConfig.from_json(c.to_json()) == c  # the manifest's copy reads back, own knobs and all
    assert scout.moe_layers == tuple(range(48)) and scout.own.qk_l2_norm
    assert scout.own.llama3_rope.factor == 16.0 and maverick.own.llama3_rope is None
    assert maverick.moe_layers == tuple(range(1, 48, 2)) and not maverick.own.qk_l2_norm
    vlm = parse_hf_config({"model_type": "llama4", "text_config": MAVERICK, "tie_word_embeddings": False})
    assert (vlm.family, vlm.model_type, vlm.own) == ("llama4", "llama4", maverick.own)


@pytest.mark.parametrize(
    "fields, named",
    [
        ({"num_experts_per_tok": 2}, "num_experts_per_tok is 2; eprt runs Llama-4's top-1 routing"),
        ({"no_rope_layers": [1, 0]}, "'no_rope_layers'"),
        ({"no_rope_layers": [1, 2, 1]}, "'no_rope_layers'"),
        ({"layer_types": ["sliding_attention"] * 3}, "'layer_types'"),
        ({"attention_chunk_size": None, "layer_types": ["chunked_attention"] * 3}, "attention_chunk_size is null"),
        ({"moe_layers": [5]}, "'moe_layers'"),
        # the tiny config as it was: transformers builds layers 1 and 2 MoE, vLLM layer 1 alone
        ({"moe_layers": [1, 2]}, r"moe_layers \[1, 2\] and interleave_moe_layer_step 2 disagree"),
        ({"interleave_moe_layer_step": 0}, "'interleave_moe_layer_step'"),
        ({"floor_scale": 0}, "'floor_scale'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": "x"}}, "'factor'"),
        ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "required field low_freq_factor is missing"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ],
)
def test_what_eprt_cannot_run_is_refused_by_name(fields, named):
    hf = {k: v for k, v in tiny_config("llama4_text", **fields).items() if v is not None or k in fields}
    if "moe_layers" not in fields and "interleave_moe_layer_step" in fields:
        hf.pop("moe_layers")
    with pytest.raises(ConfigError, match=named.replace("(", r"\(").replace(")", r"\)")):
        parse_hf_config(hf, "config.json")


@pytest.mark.parametrize("family", ["llama4_text", "llama4"])
def test_the_tiny_config_is_maverick_interleaved_as_transformers_and_vllm_read_it(family):
    """MoE every 2nd layer, as Maverick's release: transformers' moe_layers and the layers vLLM's step places."""
    transformers = pytest.importorskip("transformers")
    hf = tiny_config(family)
    text = hf.get("text_config", hf)
    theirs = transformers.Llama4TextConfig.from_dict(text).moe_layers
    step = text["interleave_moe_layer_step"]
    assert step == 2 and theirs == list(range(step - 1, text["num_hidden_layers"], step)) == [1]
    assert parse_hf_config(hf).moe_layers == tuple(theirs)


def test_transformers_own_file_of_layers_no_step_places_is_refused_naming_both_keys(tmp_path):
    """transformers writes both keys, the step at its default 1 beside a list of its own: an engine
    reading the step would make every layer MoE."""
    transformers = pytest.importorskip("transformers")
    transformers.Llama4TextConfig(num_hidden_layers=3, moe_layers=[0, 2]).save_pretrained(tmp_path)
    hf = json.loads((tmp_path / "config.json").read_text())
    assert (hf["moe_layers"], hf["interleave_moe_layer_step"]) == ([0, 2], 1)
    with pytest.raises(ConfigError, match=r"moe_layers \[0, 2\] and interleave_moe_layer_step 1 disagree"):
        parse_hf_config(hf, "config.json")
    del hf["interleave_moe_layer_step"]  # the list alone: read as transformers reads it
    assert parse_hf_config(hf, "config.json").moe_layers == (0, 2)
