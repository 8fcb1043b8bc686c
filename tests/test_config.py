"""config.json in transformers 4 and 5 spellings reads to the same ModelConfig; bad configs are refused by name;
the typed ModelConfig goes through the checkpoint manifest's JSON and back, refusing a bad one by the field's path."""

import dataclasses
import json
import os
from dataclasses import dataclass

import pytest

from eprt.config import FamilyConfig, MLAConfig, ModelConfig, MoEConfig, own_config
from eprt.errors import CheckpointError, ConfigError
from eprt.families import parse_hf_config
from eprt.families.kimi_linear.config import LatentExperts
from eprt.hf.convert import convert_hf
from eprt.storage.checkpoint import MANIFEST, Checkpoint
from eprt.testing.tiny import families, make_tiny, tiny_config


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


@pytest.mark.parametrize(
    "family,renames",
    [
        ("qwen3_moe", {"num_experts": "num_local_experts"}),
        ("deepseek_v3", {"n_routed_experts": "num_local_experts", "num_nextn_predict_layers": "num_mtp_layers"}),
    ],
)
def test_transformers_4_and_5_spellings_agree(family, renames):
    v4 = tiny_config(family)
    assert parse_hf_config(v4) == parse_hf_config(v5_spelling(v4, renames))


def test_fields_come_from_the_file_not_defaults():
    qwen = tiny_config("qwen3_moe")
    assert parse_hf_config(qwen).moe.norm_topk_prob is True  # the library default would be False
    del qwen["norm_topk_prob"]
    assert parse_hf_config(qwen).moe.norm_topk_prob is False
    ds = parse_hf_config(tiny_config("deepseek_v3"))
    assert ds.rope.yarn.mscale_all_dim == 1.0
    assert ds.moe_layers == (1, 2) and ds.moe.n_group == 4 and ds.moe.topk_group == 2


def test_layer_kinds():
    qwen = parse_hf_config(
        {**tiny_config("qwen3_moe"), "num_hidden_layers": 6, "decoder_sparse_step": 2, "mlp_only_layers": [3]}
    )
    assert qwen.moe_layers == (1, 5)


def test_kimi_k2_runs_as_deepseek_v3():
    cfg = parse_hf_config({**tiny_config("deepseek_v3"), "model_type": "kimi_k2", "n_group": 1, "topk_group": 1})
    assert cfg.family == "deepseek_v3" and cfg.model_type == "kimi_k2"


@pytest.mark.parametrize(
    "fields,message",
    [
        (
            {"model_type": "mixtral"},
            "model_type 'mixtral' is not supported; eprt reads deepseek_v3, deepseek_v32, glm4_moe, glm_moe_dsa, kimi_k2, "
            "kimi_k25, kimi_k3, kimi_linear, kimi_vl, mistral3, mistral4, qwen3_5_moe, qwen3_5_moe_text, qwen3_moe, qwen3_next",
        ),
        ({"moe_layer_freq": 2}, "moe_layer_freq"),
        (
            {"scoring_func": "softmax"},
            "only the sigmoid noaux_tc router of DeepSeek-V3 is supported .scoring_func=.softmax.",
        ),
        ({"num_hidden_layers": None}, "required field num_hidden_layers is missing"),
        ({"rope_scaling": {"type": "longrope", "factor": 2.0}}, "rope scaling type 'longrope'"),
        ({"rope_interleave": False}, "rope_interleave is false"),
        ({"num_key_value_heads": 2}, "num_key_value_heads differs from num_attention_heads"),
    ],
)
def test_refusals_name_the_setting(fields, message):
    with pytest.raises(ConfigError, match="^config.json: " + message.replace("(", r"\(")):
        parse_hf_config({**tiny_config("deepseek_v3"), **fields})


# --- the typed config ---------------------------------------------------------------------------


@pytest.mark.parametrize("family", families())
def test_every_family_round_trips_through_the_manifest_json(family):
    c = parse_hf_config(tiny_config(family))
    assert ModelConfig.from_json(json.loads(json.dumps(c.to_json()))) == c


def test_each_fact_has_one_place():
    """Attention is GQA or MLA, each with its own head sizes; a dense model has no MoE part and
    answers 0 experts; a model without RoPE says so with rope None."""
    qwen = parse_hf_config(tiny_config("qwen3_moe"))
    assert qwen.mla is None and qwen.gqa.head_dim == tiny_config("qwen3_moe")["head_dim"] == qwen.rotary_dim
    ds = parse_hf_config(tiny_config("deepseek_v3"))
    assert ds.gqa is None and ds.mla == MLAConfig(
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16
    )
    assert ds.rotary_dim == ds.mla.qk_rope_head_dim and ds.rope.theta > 0
    kimi = parse_hf_config(tiny_config("kimi_linear"))
    assert kimi.rope is None and kimi.mla is not None
    dense = parse_hf_config(tiny_config("qwen3_moe", num_experts=0))
    assert dense.moe is None and (dense.num_experts, dense.num_experts_per_tok, dense.moe_layers) == (0, 0, ())
    assert not dense.is_moe(0) and ModelConfig.from_json(dense.to_json()) == dense
    with pytest.raises(ConfigError, match="a dense model has moe None"):
        MoEConfig(
            layers=(),
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=16,
            num_shared_experts=0,
            router="softmax",
            norm_topk_prob=True,
        )


def with_field(d: dict, path: str, value) -> dict:
    """`d` (a config's JSON) with the field at dotted `path` set to `value`, or removed for `...`."""
    d = json.loads(json.dumps(d))
    *parents, name = path.split(".")
    node = d
    for p in parents:
        node = node[p]
    if value is ...:
        del node[name]
    else:
        node[name] = value
    return d


@pytest.mark.parametrize(
    "family,path,value,message",
    [
        ("qwen3_moe", "moe.num_experts", ..., r"config\.moe\.num_experts: missing"),
        ("qwen3_moe", "moe.num_experts", "8", r"config\.moe\.num_experts: is a string \('8'\), not an integer"),
        ("qwen3_moe", "moe.num_experts", 8.5, r"config\.moe\.num_experts: is a number \(8\.5\), not an integer"),
        ("qwen3_moe", "gqa.qk_norm", 1, r"config\.gqa\.qk_norm: is a number \(1\), not a boolean"),
        ("qwen3_moe", "hidden_size", True, r"config\.hidden_size: is a boolean \(True\), not an integer"),
        ("qwen3_moe", "moe.layers", 3, r"config\.moe\.layers: is a number, not a list"),
        ("qwen3_moe", "moe.layers", [0, "1"], r"config\.moe\.layers\[1\]: is a string \('1'\), not an integer"),
        ("deepseek_v3", "rope.yarn.factor", [4], r"config\.rope\.yarn\.factor: is a list \(\[4\]\), not a number"),
        ("kimi_k3", "kimi_linear.kda", None, r"config\.kimi_linear\.kda: is null, not an object of KDAConfig fields"),
        # the flat config of format version 1 is no typed config
        ("kimi_linear", "extra", {}, r"config: unknown field 'extra'; ModelConfig has family, "),
        ("deepseek_v3", "mla", None, r"config: a ModelConfig has exactly one attention: gqa or mla"),
    ],
)
def test_a_bad_config_json_is_refused_by_the_field_path(family, path, value, message):
    d = with_field(parse_hf_config(tiny_config(family)).to_json(), path, value)
    with pytest.raises(ConfigError, match="^" + message):
        ModelConfig.from_json(d)


def rewrite_manifest(ck: str, change) -> None:
    path = os.path.join(ck, MANIFEST)
    with open(path) as f:
        m = json.load(f)
    change(m)
    with open(path, "w") as f:
        json.dump(m, f)


def test_a_checkpoint_of_the_previous_format_is_refused_with_the_way_out(tmp_path):
    ck = convert_hf(make_tiny("qwen3_moe", str(tmp_path / "hf")), str(tmp_path / "ck"), progress=False)
    assert Checkpoint(ck).config == parse_hf_config(tiny_config("qwen3_moe") | {"torch_dtype": "bfloat16"})
    rewrite_manifest(ck, lambda m: m["config"]["moe"].update(num_experts="8"))
    with pytest.raises(CheckpointError, match=r"eprt\.json: corrupt manifest: config\.moe\.num_experts: is a string"):
        Checkpoint(ck)
    rewrite_manifest(ck, lambda m: m.update(version=1))
    with pytest.raises(
        CheckpointError,
        match=r"eprt\.json: format version 1, written by an older eprt; this eprt "
        r"reads version 2, .*: convert the source again \(tools/convert_hf\.py\)",
    ):
        Checkpoint(ck)


@own_config("own_knobs_test")
@dataclass(frozen=True)
class _OwnKnobs(FamilyConfig):
    clamp_limit: float
    sinks: bool


def test_a_family_own_config_round_trips_and_is_checked_by_field():
    """A knob only one family has lives in its own config, carried through the manifest JSON
    typed, and refused by its path when the JSON is wrong."""
    base = parse_hf_config(tiny_config("qwen3_moe"))
    c = dataclasses.replace(base, family="own_knobs_test", own=_OwnKnobs(7.0, True))
    d = json.loads(json.dumps(c.to_json()))
    assert d["own"] == {"clamp_limit": 7.0, "sinks": True}
    assert ModelConfig.from_json(d) == c
    assert "own" not in base.to_json()  # a family without knobs of its own writes what it always wrote
    assert ModelConfig.from_json(base.to_json()) == base
    with pytest.raises(ConfigError, match=r"config\.own\.sinks: is a string"):
        ModelConfig.from_json({**d, "own": {"clamp_limit": 7.0, "sinks": "yes"}})
    with pytest.raises(ConfigError, match=r"config\.own: family 'qwen3_moe' has no own config"):
        ModelConfig.from_json({**base.to_json(), "own": {"clamp_limit": 7.0}})


def test_kimi_k3s_latent_experts_live_in_its_own_config(tmp_path):
    """Kimi-K3's latent (a knob no other family has) is its own config's (LatentExperts). The
    manifest stores it where it always did, last in `moe`, so that every family's manifest keeps
    its bytes (a calibrated checkpoint and its export pin it by digest), and reads it back into
    the own config; a latent where the family has none is refused."""
    k3 = parse_hf_config(tiny_config("kimi_k3"))
    assert k3.own == LatentExperts(latent_size=32, latent_norm=True) and k3.routed_width == 32
    d = json.loads(json.dumps(k3.to_json()))
    assert list(d["moe"].items())[-2:] == [("latent_size", 32), ("latent_norm", True)] and "own" not in d
    assert ModelConfig.from_json(d) == k3
    for family in ("qwen3_moe", "kimi_linear"):
        c = parse_hf_config(tiny_config(family))
        d = c.to_json()
        assert list(d["moe"].items())[-2:] == [("latent_size", None), ("latent_norm", False)] and "own" not in d
        assert c.own is None and ModelConfig.from_json(d) == c and c.routed_width == c.hidden_size
    with pytest.raises(ConfigError, match=r"config\.own: family 'qwen3_moe' has no own config"):
        ModelConfig.from_json(with_field(parse_hf_config(tiny_config("qwen3_moe")).to_json(), "moe.latent_size", 32))
    ck = convert_hf(make_tiny("kimi_k3", str(tmp_path / "hf")), str(tmp_path / "ck"), progress=False)
    assert Checkpoint(ck).config.own == k3.own
