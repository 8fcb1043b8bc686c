"""Qwen3-Next and Qwen3.5-MoE against transformers on tiny random checkpoints, in float32; the chunked
gated delta rule against its recurrence; the config fields in both transformers spellings."""

import pytest
import torch
from safetensors.torch import load_file, save_file

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import (
    AutoConfig,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,  # noqa: E402
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

import eprt  # noqa: E402
from eprt.config import ModelConfig  # noqa: E402
from eprt.errors import CheckpointError, ConfigError  # noqa: E402
from eprt.families import model_class, parse_hf_config, reader_for  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.models.gated_delta import GatedDeltaNet, gated_delta_chunked, gated_delta_recurrent, gated_delta_rule  # noqa: E402
from eprt.models.kda import chunk_size, l2norm  # noqa: E402
from eprt.testing.tiny import make_tiny, tiny_config  # noqa: E402
from tests.hf_utils import raw, read_hf_tensors  # noqa: E402
from tests.oracles.test_models import TINY, VOCAB, assert_logits_and_carried  # noqa: E402

# --- the gated delta rule ---------------------------------------------------------------------


def gdn_inputs(T: int, decay: float, B: int = 2, Hk: int = 2, Hv: int = 4, Dk: int = 16, Dv: int = 12):
    """(q, k) per key head as the short convolution gives them, v, g and beta per value head."""
    g = torch.Generator().manual_seed(T)
    q, k = torch.randn(B, T, Hk, Dk, generator=g), torch.randn(B, T, Hk, Dk, generator=g)
    v = torch.randn(B, T, Hv, Dv, generator=g)
    log_decay = -decay * torch.sigmoid(2 * torch.randn(B, T, Hv, generator=g))
    return q, k, v, log_decay, torch.rand(B, T, Hv, generator=g)


# decay per token up to 0.1 (chunks of 64) and up to 40 (chunks of 2: a chunk of 64 would overflow fp32)
@pytest.mark.parametrize("decay", [0.1, 40.0])
@pytest.mark.parametrize("T", [1, 37, 64, 130])
def test_chunked_gated_delta_rule_equals_the_recurrence(T, decay):
    q, k, v, g, beta = gdn_inputs(T, decay)
    # each key head serves two value heads, consecutive
    qn, kn = (l2norm(x).repeat_interleave(2, dim=2) for x in (q, k))
    qn = qn * q.shape[-1] ** -0.5
    want = gated_delta_recurrent(qn, kn, v, g, beta)
    torch.testing.assert_close(gated_delta_chunked(qn, kn, v, g, beta), want, rtol=0, atol=1e-5)
    # shorter chunks than chosen are as exact: the state passes from chunk to chunk
    chosen = chunk_size(g[..., None])
    assert chosen == (64 if decay < 1 or T == 1 else 2)
    torch.testing.assert_close(gated_delta_chunked(qn, kn, v, g, beta, chunk=min(8, chosen)), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(gated_delta_rule(q, k, v, g, beta), want, rtol=0, atol=1e-5)


def test_a_sequence_output_does_not_depend_on_its_batch():
    """Each sequence's chunk size comes from its own decay: batched with a fast-decaying sequence
    (chunks of 2), a slow one (chunks of 64) gives the bits it gives alone."""
    slow, fast = gdn_inputs(40, 0.1), gdn_inputs(40, 40.0)
    both = [torch.cat([a[:1], b[:1]]) for a, b in zip(slow, fast)]
    alone = gated_delta_rule(*(x[:1] for x in slow))
    assert torch.equal(gated_delta_rule(*both)[:1], alone)


# --- Qwen3-Next against transformers ----------------------------------------------------------


# Qwen3-Next's and Qwen3.5's shared shape: gated delta layers between full attention ones
HYBRID = dict(
    TINY,
    num_hidden_layers=4,
    num_key_value_heads=2,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    shared_expert_intermediate_size=24,
    num_experts=8,
    layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
    max_position_embeddings=128,
    pad_token_id=None,
    bos_token_id=None,
    eos_token_id=None,
)


def qwen3_next(**kw) -> Qwen3NextConfig:
    base = dict(
        HYBRID,
        mlp_only_layers=[2],
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    )
    return Qwen3NextConfig(**{**base, **kw})


def randomize(model) -> None:
    """Norm weights away from their zero init (they scale by 1 + weight), routers spread enough
    that routing does not hinge on near-ties."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                p.normal_(0, 0.3)


QWEN3_NEXT_CASES = {
    # value heads shared by key heads, a dense layer, half of each head rotated, 70 tokens (past a chunk)
    "gva_dense_70_tokens": (dict(), 70),
    # one value head per key head, experts everywhere, a quarter rotated, un-normalized top k, yarn
    "moe_everywhere_yarn": (
        dict(
            linear_num_value_heads=2,
            mlp_only_layers=[],
            norm_topk_prob=False,
            layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 32,
                "partial_rotary_factor": 0.25,
            },
        ),
        12,
    ),
}


@pytest.mark.parametrize("case", QWEN3_NEXT_CASES)
def test_qwen3_next_logits(tmp_path, case):
    overrides, T = QWEN3_NEXT_CASES[case]
    torch.manual_seed(0)
    m = Qwen3NextForCausalLM(qwen3_next(**overrides)).eval()
    randomize(m)
    m.save_pretrained(tmp_path / "hf")
    em = eprt.load_model(convert_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), progress=False), dtype=torch.float32)
    linear = [i for i, t in enumerate(m.config.layer_types) if t == "linear_attention"]
    assert [
        i for i, layer in enumerate(em.model.layers) if isinstance(getattr(layer, "linear_attn", None), GatedDeltaNet)
    ] == linear
    assert [i for i, _ in em.moe_blocks()] == [i for i in range(4) if i not in m.config.mlp_only_layers]
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = m(ids).logits, em(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


# --- Qwen3.5-MoE against transformers ---------------------------------------------------------


def qwen3_5_text(**kw) -> dict:
    base = dict(
        HYBRID,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [1, 1, 2],
            "mrope_interleaved": True,
        },
    )
    return {**base, **kw}


def add_tensors(hf_dir, tensors: dict) -> None:
    path = hf_dir / "model.safetensors"
    save_file({**load_file(path), **tensors}, path, metadata={"format": "pt"})


def test_qwen3_5_moe_logits_and_carried_tensors(tmp_path):
    """The VLM as released: text model under model.language_model, head lm_head; the vision tower
    and the MTP layers come out of convert and export byte for byte."""
    torch.manual_seed(0)
    vision = dict(
        depth=1,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        out_hidden_size=32,
        patch_size=4,
        num_position_embeddings=16,
    )
    m = Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=qwen3_5_text(), vision_config=vision)).eval()
    randomize(m)
    m.save_pretrained(tmp_path / "hf")
    add_tensors(
        tmp_path / "hf", {"mtp.fc.weight": torch.randn(32, 64), "mtp.layers.0.input_layernorm.weight": torch.randn(32)}
    )
    assert_logits_and_carried(tmp_path, m, "qwen3_5_moe", [0, 1, 2, 3], 70, ("model.visual.", "mtp."))


def test_qwen3_5_moe_text_logits(tmp_path):
    """The language model saved alone (`qwen3_5_moe_text`, tensors under model.), un-normalized
    top k impossible: Qwen3.5 always renormalizes."""
    torch.manual_seed(0)
    m = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**qwen3_5_text(linear_num_value_heads=2))).eval()
    randomize(m)
    m.save_pretrained(tmp_path / "hf")
    em = eprt.load_model(convert_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), progress=False), dtype=torch.float32)
    assert em.config.model_type == "qwen3_5_moe_text" and em.config.moe.norm_topk_prob
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = m(input_ids=ids).logits, em(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


def test_qwen3_5_moe_configs():
    vlm, text = parse_hf_config(tiny_config("qwen3_5_moe")), parse_hf_config(tiny_config("qwen3_5_moe_text"))
    assert (vlm.family, vlm.model_type, text.family, text.model_type) == (
        "qwen3_5_moe",
        "qwen3_5_moe",
        "qwen3_5_moe_text",
        "qwen3_5_moe_text",
    )
    for c in (vlm, text):
        g = c.qwen_next.gated_delta_net
        assert g.split_projections and g.layers == (0, 1, 2) and c.rotary_dim == 8
        assert c.moe_layers == (0, 1, 2, 3) and c.moe.norm_topk_prob and c.rope.theta == 1e7
    # the VLM's top-level tie_word_embeddings reaches the text model
    tied = tiny_config("qwen3_5_moe")
    tied = {
        **tied,
        "tie_word_embeddings": True,
        "text_config": {k: v for k, v in tied["text_config"].items() if k != "tie_word_embeddings"},
    }
    assert parse_hf_config(tied).tie_word_embeddings
    with pytest.raises(ConfigError, match="text_config"):
        parse_hf_config({"model_type": "qwen3_5_moe"})


def save_as_released(model, hf_dir) -> None:
    """The model's parameters as they are, each layer's experts fused (experts.gate_up_proj,
    experts.down_proj), as Qwen publishes Qwen3.5-MoE; transformers' save_pretrained would split them."""
    hf_dir.mkdir()
    model.config.save_pretrained(hf_dir)
    save_file(
        {n: t.contiguous() for n, t in model.state_dict().items()},
        str(hf_dir / "model.safetensors"),
        metadata={"format": "pt"},
    )


def test_experts_stored_fused_convert_and_export_back_byte_for_byte(tmp_path):
    torch.manual_seed(0)
    m = Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**qwen3_5_text())).eval()
    randomize(m)
    save_as_released(m, tmp_path / "hf")
    source = read_hf_tensors(str(tmp_path / "hf"))
    assert {n for n in source if ".experts." in n} == {
        f"model.layers.{i}.mlp.experts.{p}" for i in range(4) for p in ("gate_up_proj", "down_proj")
    }
    ck = convert_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), progress=False)
    em = eprt.load_model(ck, dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = m(input_ids=ids).logits, em(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    exported = read_hf_tensors(export_hf(ck, str(tmp_path / "export"), progress=False))
    assert set(exported) == set(source)
    for n in source:
        assert exported[n].dtype == source[n].dtype and raw(exported[n]) == raw(source[n]), n


@pytest.mark.parametrize("family", ["qwen3_5_moe", "qwen3_5_moe_text"])
def test_tiny_fused_experts_are_the_transformers_parameters(tmp_path, family):
    hf = make_tiny(family, str(tmp_path / "hf"), fused_experts=True)
    model_cls = Qwen3_5MoeForConditionalGeneration if family == "qwen3_5_moe" else Qwen3_5MoeForCausalLM
    with torch.device("meta"):
        model = model_cls(AutoConfig.from_pretrained(hf))
    want = {n: tuple(t.shape) for n, t in model.state_dict().items() if ".experts." in n}
    assert {n: tuple(t.shape) for n, t in read_hf_tensors(hf).items() if ".experts." in n} == want


def test_experts_stored_both_fused_and_per_expert_are_refused(tmp_path):
    hf = make_tiny("qwen3_5_moe_text", str(tmp_path / "hf"), fused_experts=True)
    add_tensors(tmp_path / "hf", {"model.layers.2.mlp.experts.3.up_proj.weight": torch.zeros(16, 32)})
    with pytest.raises(
        CheckpointError,
        match=r"'model\.layers\.2\.mlp\.experts\.gate_up_proj' holds every expert .* "
        r"'model\.layers\.2\.mlp\.experts\.3\.up_proj\.weight' holds one",
    ):
        convert_hf(hf, str(tmp_path / "ck"), progress=False)
    assert not (tmp_path / "ck").exists()


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text"])
def test_parameter_names_are_the_layout_names(family):
    c = parse_hf_config(tiny_config(family))
    with torch.device("meta"):
        model = model_class(c)(c)
    want = {s.name: s.shape for s in reader_for(c.model_type, "test").layout(c).specs}
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == want


def test_qwen3_next_config_in_both_spellings():
    v4 = tiny_config("qwen3_next")  # full_attention_interval, partial_rotary_factor and rope_theta on top
    c4 = parse_hf_config(v4)
    layer_types = ["linear_attention", "full_attention"] * 2
    v5 = {k: v for k, v in v4.items() if k not in ("full_attention_interval", "partial_rotary_factor", "rope_theta")}
    v5 |= {
        "layer_types": layer_types,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    }
    assert parse_hf_config(v5) == c4
    g = c4.qwen_next.gated_delta_net
    assert (g.layers, g.key_heads, g.value_heads, g.key_head_dim, g.value_head_dim, g.conv_kernel) == (
        (0, 2),
        2,
        4,
        16,
        16,
        4,
    )
    assert (c4.rotary_dim, c4.qwen_next.shared_expert_intermediate_size, c4.rope.theta) == (8, 48, 1e7)
    assert c4.moe_layers == (0, 1, 3) and c4.moe.norm_topk_prob and c4.num_experts_per_tok == 2
    # the manifest's JSON brings the typed sub-config back
    assert ModelConfig.from_json(c4.to_json()) == c4
    # transformers' default interval is 4
    no_types = {k: v for k, v in v4.items() if k != "full_attention_interval"}
    assert parse_hf_config({**no_types, "num_hidden_layers": 8}).qwen_next.gated_delta_net.layers == (0, 1, 2, 4, 5, 6)


@pytest.mark.parametrize(
    "fields,message",
    [
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"attention_bias": True}, "attention_bias is true"),
        ({"linear_num_value_heads": 3}, "not a multiple of linear_num_key_heads"),
        (
            {"layer_types": ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]},
            "layer_types must list",
        ),
        ({"layer_types": ["linear_attention"]}, "layer_types must list"),
    ],
)
def test_qwen3_next_refusals_name_the_setting(fields, message):
    with pytest.raises(ConfigError, match=message):
        parse_hf_config({**tiny_config("qwen3_next"), **fields})
