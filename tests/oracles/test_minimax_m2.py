"""MiniMax-M2 / M2.5 / M2.7 (`minimax_m2`): logits equal transformers' MiniMaxM2ForCausalLM (fp32)
with every piece on (the q/k norm over the whole projection, partial rotary from either spelling,
the sigmoid router with its correction bias), at several sizes; expert-parallel logits equal the
single-process ones; a PTQ export is the same bytes at every (world, ep); the block-FP8 release
runs decoded and exports back byte for byte."""

import pytest
import torch
from safetensors.torch import save_file

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM  # noqa: E402

from eprt.errors import ConfigError  # noqa: E402
from eprt.families import model_class, parse_hf_config, reader_for  # noqa: E402
from eprt.hf.check_export import check_export  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.models.layers import linear  # noqa: E402
from eprt.models.router import sigmoid_grouped_topk  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import make_tiny, tiny_config  # noqa: E402
from tests.ep_checks import assert_ep_logits, assert_exports_layout_invariant, tiny_checkpoints  # noqa: E402
from tests.hf_utils import raw, read_hf_tensors  # noqa: E402
from tests.oracles.test_models import VOCAB, YARN, assert_matches_transformers, record_routing, tokens  # noqa: E402
from tests.test_compressed import assert_block_fp8_source_runs_decoded_and_exports_back  # noqa: E402
from tests.test_roundtrip import assert_same_checkpoint  # noqa: E402

FAMILY = "minimax_m2"


def minimax(**kw) -> MiniMaxM2Config:
    base = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=16,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=64,
        rotary_dim=8,
        initializer_range=0.1,
    )
    return MiniMaxM2Config(**{**base, **kw})


def build(cfg: MiniMaxM2Config, seed: int = 0) -> MiniMaxM2ForCausalLM:
    """A random transformers model whose routers spread their scores and whose correction biases
    and q/k norm weights are not their neutral init (zeros, ones), so that each one matters."""
    torch.manual_seed(seed)
    m = MiniMaxM2ForCausalLM(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.3)
            layer.mlp.e_score_correction_bias.normal_(0, 0.1)
            layer.self_attn.q_norm.weight.normal_(1, 0.3)
            layer.self_attn.k_norm.weight.normal_(1, 0.3)
    return m


CASES = {
    "half_rotary_gqa": dict(),
    "quarter_rotary_yarn_mqa_top3": dict(
        rotary_dim=4, num_key_value_heads=1, num_experts_per_tok=3, rope_parameters={**YARN, "rope_theta": 5e6}
    ),
    "full_rotary_wide_heads_tied": dict(
        rotary_dim=32, head_dim=32, num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_minimax_m2_logits(tmp_path, case):
    cfg = minimax(**CASES[case])
    em, _ = assert_matches_transformers(tmp_path, build(cfg))
    c = em.config
    assert c.gqa.rotary_dim == int(cfg.head_dim * cfg.rope_parameters["partial_rotary_factor"]) == cfg.rotary_dim
    assert [i for i, _ in em.moe_blocks()] == list(range(cfg.num_hidden_layers))
    assert_bias_and_whole_norm_matter(em, cfg)


def assert_bias_and_whole_norm_matter(em, cfg):
    """On the tokens the test runs, the correction bias changes which experts some token gets, and
    the q/k norm over the whole projection differs from one per head: the oracle tells them apart."""
    changed = False
    for layer, (x, ids, _) in record_routing(em, tokens()).items():
        block = dict(em.moe_blocks())[layer]
        logits = linear(x.float(), block.gate.weight.float())

        def route(bias):
            return sigmoid_grouped_topk(logits, bias, cfg.num_experts_per_tok, 1, 1, True, 1.0)[0].sort(-1).values

        assert torch.equal(ids.sort(-1).values, route(block.e_score_correction_bias))
        changed |= not torch.equal(route(torch.zeros(cfg.num_local_experts)), route(block.e_score_correction_bias))
    assert changed
    attn = em.model.layers[0].self_attn
    q_THd = torch.randn(3, cfg.num_attention_heads, cfg.head_dim)
    per_head = (q_THd * torch.rsqrt(q_THd.pow(2).mean(-1, keepdim=True) + cfg.rms_norm_eps)).flatten(-2)
    assert not torch.allclose(attn.q_norm(q_THd.flatten(-2)), per_head * attn.q_norm.weight, rtol=1e-3, atol=1e-4)


def test_the_release_spelling_reads_as_transformers_saves_it():
    """The release says `rotary_dim` and `rope_theta` on the top level, with its fixed switches
    (use_qk_norm, scoring_func, ...); transformers 5 writes `rope_parameters` with
    partial_rotary_factor. Both read the same."""
    release = tiny_config(FAMILY)
    saved = minimax(
        vocab_size=512, hidden_size=64, intermediate_size=32, max_position_embeddings=512, rope_theta=5e6
    ).to_dict()
    a, b = parse_hf_config(release), parse_hf_config(saved)
    assert a.gqa == b.gqa and a.moe == b.moe and a.rope == b.rope and a.own == b.own
    assert a.gqa.rotary_dim == 8 and a.rope.theta == 5e6 and a.intermediate_size == 0
    assert parse_hf_config({k: v for k, v in release.items() if k != "rotary_dim"}).gqa.rotary_dim == 16


@pytest.mark.parametrize(
    "field,value,says",
    [
        ("use_qk_norm", False, "use_qk_norm is False"),
        ("qk_norm_type", "per_head", "qk_norm_type is 'per_head'"),
        ("scoring_func", "softmax", "scoring_func is 'softmax'"),
        ("use_routing_bias", False, "use_routing_bias is False"),
        ("shared_intermediate_size", 1536, "shared_intermediate_size is 1536"),
        ("attn_type_list", [0, 1], "attn_type_list marks linear-attention layers"),
        ("attn_type_list", "11", "field 'attn_type_list' is '11'; it must be a JSON list"),
        ("rotary_dim", 7, "rotary_dim 7 of head_dim 16: RoPE rotates an even count"),
        ("rotary_dim", 64, "rotary_dim 64 of head_dim 16"),
        ("rotary_dim", "64", "field 'rotary_dim' is '64'; it must be an integer"),
        ("num_local_experts", 0, "num_local_experts is 0: every MiniMax-M2 layer routes"),
    ],
)
def test_what_minimax_m2_does_not_have_is_refused_by_field(field, value, says):
    with pytest.raises(ConfigError, match="tiny.json: " + says.replace("(", r"\(").replace("[", r"\[")):
        parse_hf_config(tiny_config(FAMILY, **{field: value}), "tiny.json")


def test_mtp_modules_are_carried_by_name(tmp_path):
    """Multi-token-prediction modules stored after the decoder travel through convert and export as stored."""
    c = parse_hf_config(tiny_config(FAMILY, use_mtp=True, num_mtp_modules=3))
    layout = reader_for(c.model_type, "test").layout(c)
    assert c.own.mtp_modules == 3
    assert [layout.is_passthrough(f"model.layers.{i}.self_attn.q_proj.weight") for i in range(6)] == [0, 0, 1, 1, 1, 0]
    assert parse_hf_config(tiny_config(FAMILY, num_mtp_modules=3)).own.mtp_modules == 0  # use_mtp off

    hf = make_tiny(FAMILY, str(tmp_path / "hf"), use_mtp=True, num_mtp_modules=1)
    path = tmp_path / "hf" / "model.safetensors"
    tensors = {
        **read_hf_tensors(str(tmp_path / "hf")),
        "model.layers.2.block_sparse_moe.experts.0.w1.weight": torch.ones(32, 64),
    }
    save_file(tensors, str(path), metadata={"format": "pt"})
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    assert_same_checkpoint(hf, export_hf(ck, str(tmp_path / "out"), progress=False))


def test_parameter_names_are_the_layout_names():
    c = parse_hf_config(tiny_config(FAMILY))
    with torch.device("meta"):
        model = model_class(c)(c)
    want = {s.name: s.shape for s in reader_for(c.model_type, "test").layout(c).specs}
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == want
    assert want["model.layers.0.self_attn.q_norm.weight"] == (64,)  # 4 heads of 16: the whole projection
    assert want["model.layers.0.self_attn.k_norm.weight"] == (32,)


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


# Block FP8 with partial last blocks: hidden 192 (a block and a half), experts 144 wide
FP8 = dict(hidden_size=192, intermediate_size=144)


def test_block_fp8_release_runs_decoded_and_exports_back(tmp_path):
    """The release ships block FP8 (`weight_scale_inv` per 128x128 block; the router, embeddings,
    norms and head in bf16): it stays encoded, runs as if decoded ahead of time, exports back byte
    for byte, and a quantized export of it passes the checks."""
    hf = make_tiny(FAMILY, str(tmp_path / "fp8-hf"), source_format="fp8-block", **FP8)
    source = read_hf_tensors(hf)
    layer0 = "model.layers.0"
    assert f"{layer0}.block_sparse_moe.experts.3.w2.weight_scale_inv" in source
    assert f"{layer0}.self_attn.q_proj.weight_scale_inv" in source
    assert f"{layer0}.block_sparse_moe.gate.weight_scale_inv" not in source
    ck = assert_block_fp8_source_runs_decoded_and_exports_back(hf, tmp_path)

    run_ptq(
        ParallelState.single(),
        PTQArgs(ck, "nvfp4", str(tmp_path / "q"), calib_size=2, seq_len=16, batch_size=2, dtype="bf16", progress=False),
    )
    out = export_hf(str(tmp_path / "q"), str(tmp_path / "x"), progress=False)
    assert check_export(out, hf) == []
    got = read_hf_tensors(out)
    assert got[f"{layer0}.self_attn.q_proj.weight"].dtype == torch.uint8  # NVFP4 from the decoded weight
    assert raw(got[f"{layer0}.block_sparse_moe.gate.weight"]) == raw(source[f"{layer0}.block_sparse_moe.gate.weight"])
    assert f"{layer0}.block_sparse_moe.experts.0.w1.weight_scale_2" in got
