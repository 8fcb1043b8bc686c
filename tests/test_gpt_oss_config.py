"""GPT-OSS's config.json as the releases write it (gpt-oss-20b's fields; transformers' defaults where a
file leaves one out), and the settings eprt cannot run refused by name."""

import pytest

from eprt.errors import ConfigError
from eprt.families import parse_hf_config
from eprt.layout import ClampedSwiGLU
from eprt.testing.tiny import tiny_config

# gpt-oss-20b's config.json, its fields that set the model
RELEASE_20B = dict(
    model_type="gpt_oss",
    architectures=["GptOssForCausalLM"],
    vocab_size=201088,
    hidden_size=2880,
    num_hidden_layers=24,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    intermediate_size=2880,
    num_local_experts=32,
    num_experts_per_tok=4,
    experts_per_token=4,
    layer_types=["sliding_attention", "full_attention"] * 12,
    sliding_window=128,
    swiglu_limit=7.0,
    attention_bias=True,
    rms_norm_eps=1e-05,
    rope_theta=150000,
    rope_scaling={
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    max_position_embeddings=131072,
    tie_word_embeddings=False,
    quantization_config={"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]},
)


def test_gpt_oss_20b_as_released():
    c = parse_hf_config(RELEASE_20B)
    assert (c.family, c.num_layers, c.num_heads, c.gqa.num_kv_heads, c.gqa.head_dim) == ("gpt_oss", 24, 64, 8, 64)
    assert c.gqa.qkv_bias and c.gqa.output_bias and not c.gqa.qk_norm
    assert c.moe.layers == tuple(range(24)) and (c.moe.num_experts, c.moe.num_experts_per_tok) == (32, 4)
    assert c.own.sliding_layers == tuple(range(0, 24, 2)) and c.own.sliding_window == 128
    assert c.own.activation == ClampedSwiGLU(1.702, 7.0)
    assert c.rope.theta == 150000 and c.rope.yarn.factor == 32.0 and c.rope.yarn.truncate is False


def test_transformers_defaults_where_the_file_leaves_them_out():
    """No layer_types: even layers slide; no rope fields: transformers' YaRN default; no clamps: 1.702 and 7."""
    bare = {
        k: v for k, v in RELEASE_20B.items() if k not in ("layer_types", "rope_theta", "rope_scaling", "swiglu_limit")
    }
    c = parse_hf_config(bare)
    assert c.own.sliding_layers == tuple(range(0, 24, 2))
    assert (c.rope.theta, c.rope.yarn.factor, c.rope.yarn.original_max_position_embeddings) == (150000.0, 32.0, 4096)
    assert c.rope.yarn.truncate is False and c.own.activation == ClampedSwiGLU()


@pytest.mark.parametrize(
    "fields, culprit",
    [
        (dict(layer_types=["sliding_attention"] * 3), "layer_types"),
        (dict(layer_types=["sliding_attention", "chunked_attention"]), "layer_types"),
        (dict(sliding_window=0), "sliding_window"),
        (dict(num_local_experts=0), "num_local_experts"),
        (dict(swiglu_limit=-1.0), "swiglu_limit"),
    ],
)
def test_what_eprt_cannot_run_is_refused_by_name(fields, culprit):
    with pytest.raises(ConfigError, match=culprit):
        parse_hf_config(tiny_config("gpt_oss", **fields))
