"""config.json in transformers 4 and 5 spellings reads to the same ModelConfig; bad configs are refused by name."""

import pytest

from eprt.errors import ConfigError
from eprt.families import parse_hf_config
from eprt.testing.tiny import tiny_config


def v5_spelling(hf: dict, renames: dict) -> dict:
    """The same config as transformers 5 writes it: rope_parameters, and renamed fields."""
    hf = dict(hf)
    rope = {"rope_type": "default", "rope_theta": hf.pop("rope_theta")}
    scaling = hf.pop("rope_scaling", None)
    if scaling:
        scaling = dict(scaling)
        rope["rope_type"] = scaling.pop("type")
        rope.update(scaling)
    hf["rope_parameters"] = rope
    for old, new in renames.items():
        hf[new] = hf.pop(old)
    return hf


@pytest.mark.parametrize("family,renames", [
    ("qwen3_moe", {"num_experts": "num_local_experts"}),
    ("deepseek_v3", {"n_routed_experts": "num_local_experts", "num_nextn_predict_layers": "num_mtp_layers"}),
])
def test_transformers_4_and_5_spellings_agree(family, renames):
    v4 = tiny_config(family)
    assert parse_hf_config(v4) == parse_hf_config(v5_spelling(v4, renames))


def test_fields_come_from_the_file_not_defaults():
    qwen = tiny_config("qwen3_moe")
    assert parse_hf_config(qwen).norm_topk_prob is True  # the library default would be False
    del qwen["norm_topk_prob"]
    assert parse_hf_config(qwen).norm_topk_prob is False
    ds = parse_hf_config(tiny_config("deepseek_v3"))
    assert ds.rope_scaling["type"] == "yarn" and ds.rope_scaling["mscale_all_dim"] == 1.0
    assert ds.moe_layers == (1, 2) and ds.n_group == 4 and ds.topk_group == 2


def test_layer_kinds():
    qwen = parse_hf_config({**tiny_config("qwen3_moe"), "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]})
    assert qwen.moe_layers == (1, 5)


def test_kimi_k2_runs_as_deepseek_v3():
    cfg = parse_hf_config({**tiny_config("deepseek_v3"), "model_type": "kimi_k2", "n_group": 1, "topk_group": 1})
    assert cfg.family == "deepseek_v3" and cfg.model_type == "kimi_k2"


@pytest.mark.parametrize("fields,message", [
    ({"model_type": "mixtral"}, "model_type 'mixtral' is not supported; eprt reads deepseek_v3, deepseek_v32, glm4_moe, kimi_k2, kimi_k25, "
                                "kimi_k3, kimi_linear, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe, qwen3_next"),
    ({"moe_layer_freq": 2}, "moe_layer_freq"),
    ({"scoring_func": "softmax"}, "only the sigmoid noaux_tc router of DeepSeek-V3 is supported .scoring_func=.softmax."),
    ({"num_hidden_layers": None}, "required field num_hidden_layers is missing"),
    ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope scaling type 'longrope'"),
    ({"rope_interleave": False}, "rope_interleave is false"),
    ({"num_key_value_heads": 2}, "num_key_value_heads differs from num_attention_heads"),
])
def test_refusals_name_the_setting(fields, message):
    with pytest.raises(ConfigError, match="^config.json: " + message.replace("(", r"\(")):
        parse_hf_config({**tiny_config("deepseek_v3"), **fields})
