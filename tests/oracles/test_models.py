"""eprt's models give transformers' logits: tiny random models saved with save_pretrained,
converted, loaded with eprt.load_model."""

import json

import pytest
import torch

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM  # noqa: E402

import eprt  # noqa: E402
from eprt.errors import ConfigError  # noqa: E402
from eprt.families import model_class, parse_hf_config, reader_for  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.kernels import combine, permute  # noqa: E402
from eprt.models.layers import linear  # noqa: E402
from eprt.models.moe import LocalDispatcher  # noqa: E402
from eprt.models.router import sigmoid_grouped_topk  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402
from tests.hf_utils import raw, read_hf_tensors  # noqa: E402

VOCAB = 96
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
}
# Kimi-K2's own rope_scaling: beta_fast = beta_slow = 1 and mscale = mscale_all_dim.
KIMI_YARN = {
    "rope_type": "yarn",
    "rope_theta": 50000.0,
    "factor": 32.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 1.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}


# the sizes every tiny transformers model of these tests shares
TINY = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    intermediate_size=48,
    num_attention_heads=4,
    moe_intermediate_size=16,
    num_experts_per_tok=2,
    max_position_embeddings=64,
)
# DeepSeek-V3's MLA and grouped routing at tiny sizes, shared by the families built on it
DEEPSEEK = dict(
    TINY,
    num_hidden_layers=3,
    num_key_value_heads=4,
    n_routed_experts=8,
    n_shared_experts=1,
    kv_lora_rank=16,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    qk_nope_head_dim=16,
    v_head_dim=12,
    n_group=4,
    topk_group=2,
    first_k_dense_replace=1,
    initializer_range=0.1,
)


def qwen(**kw) -> Qwen3MoeConfig:
    base = dict(TINY, num_hidden_layers=2, num_key_value_heads=2, head_dim=16, num_experts=8, initializer_range=0.1)
    return Qwen3MoeConfig(**{**base, **kw})


def deepseek(**kw) -> DeepseekV3Config:
    return DeepseekV3Config(**{**DEEPSEEK, **kw})


def build(cfg, seed: int = 0, cls=None):
    """A random transformers model (Qwen3-MoE or DeepSeek-V3 unless `cls` says) whose routers spread
    their scores: the default init makes every router logit nearly 0, so that routing would hinge
    on near-ties and groups would not matter."""
    torch.manual_seed(seed)
    cls = cls or (Qwen3MoeForCausalLM if isinstance(cfg, Qwen3MoeConfig) else DeepseekV3ForCausalLM)
    m = cls(cfg).eval()
    with torch.no_grad():
        for layer in m.model.layers:
            gate = getattr(layer.mlp, "gate", None)
            if gate is not None:
                gate.weight.normal_(0, 0.3)
                if hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.normal_(0, 0.1)
    return m


def to_eprt(tmp_path, m, model_type: str | None = None) -> str:
    hf, ck = tmp_path / "hf", tmp_path / "ck"
    m.save_pretrained(hf)
    if model_type:
        cfg = json.loads((hf / "config.json").read_text())
        (hf / "config.json").write_text(json.dumps({**cfg, "model_type": model_type}))
    return convert_hf(str(hf), str(ck), progress=False)


def tokens(B: int = 2, T: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (B, T), generator=torch.Generator().manual_seed(seed))


def record_routing(model, ids) -> dict[int, tuple]:
    """Run the model with a dispatcher that records each MoE block's (x, topk_ids, topk_weights)."""
    seen = {}

    def make(layer, block):
        local = LocalDispatcher()

        def dispatch(x_TD, topk_ids_TK, topk_weights_TK, experts):
            seen[layer] = (x_TD, topk_ids_TK, topk_weights_TK)
            return local(x_TD, topk_ids_TK, topk_weights_TK, experts)

        return dispatch

    model.set_dispatcher(make)
    with torch.no_grad():
        model(ids)
    model.set_dispatcher(lambda layer, block: LocalDispatcher())
    return seen


def assert_matches_transformers(tmp_path, m, model_type=None):
    em = eprt.load_model(to_eprt(tmp_path, m, model_type), dtype=torch.float32)
    ids = tokens()
    with torch.no_grad():
        want, got = m(ids).logits, em(ids)
    assert got.shape == (*ids.shape, VOCAB) and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    return em, want


def assert_logits_and_carried(tmp_path, m, family: str, moe_layers: list[int], T: int, carried: tuple[str, ...]):
    """The checkpoint saved under tmp_path/hf converts to `family` with its MoE blocks at `moe_layers`,
    gives `m`'s logits on T tokens, and exports every source tensor, those under `carried` (the parts
    eprt does not model) byte for byte."""
    ck = convert_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), progress=False)
    em = eprt.load_model(ck, dtype=torch.float32)
    assert em.config.family == family and [i for i, _ in em.moe_blocks()] == moe_layers
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = m(input_ids=ids).logits, em(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    source = read_hf_tensors(str(tmp_path / "hf"))
    exported = read_hf_tensors(export_hf(ck, str(tmp_path / "export"), progress=False))
    assert set(exported) == set(source)
    kept = [n for n in source if n.startswith(carried)]
    assert len(kept) > 10
    for n in kept:
        assert exported[n].dtype == source[n].dtype and raw(exported[n]) == raw(source[n]), n


QWEN_CASES = {
    "norm_topk_prob": dict(norm_topk_prob=True),
    "no_norm_topk_prob": dict(norm_topk_prob=False),
    "sparse_step_2_mlp_only": dict(num_hidden_layers=4, decoder_sparse_step=2, mlp_only_layers=[3]),
    "yarn_tied_bias": dict(
        rope_parameters={**YARN, "mscale": None, "mscale_all_dim": None}, tie_word_embeddings=True, attention_bias=True
    ),
}


@pytest.mark.parametrize("case", QWEN_CASES)
def test_qwen3_moe_logits(tmp_path, case):
    em, _ = assert_matches_transformers(tmp_path, build(qwen(**QWEN_CASES[case])))
    routes = record_routing(em, tokens())
    moe = [i for i, _ in em.moe_blocks()]
    assert moe == ([1] if case == "sparse_step_2_mlp_only" else [0, 1])
    sums = torch.cat([w.sum(-1) for _, _, w in routes.values()])
    if em.config.moe.norm_topk_prob:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    else:
        assert (sums < 0.999).all()


DEEPSEEK_CASES = {
    "q_lora_groups_yarn": dict(rope_parameters=YARN),
    "no_q_lora_two_shared": dict(q_lora_rank=None, n_shared_experts=2, n_group=2, topk_group=1),
    "all_moe_tied": dict(first_k_dense_replace=0, num_hidden_layers=2, tie_word_embeddings=True, norm_topk_prob=False),
}


@pytest.mark.parametrize("case", DEEPSEEK_CASES)
def test_deepseek_v3_logits(tmp_path, case):
    cfg = deepseek(**DEEPSEEK_CASES[case])
    em, _ = assert_matches_transformers(tmp_path, build(cfg))
    assert [i for i, _ in em.moe_blocks()] == list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))
    assert_groups_and_bias_matter(em, cfg)


def test_kimi_k2_logits(tmp_path):
    """Kimi-K2 is DeepSeek-V3 with model_type kimi_k2, one expert group and its own YaRN settings."""
    cfg = deepseek(n_group=1, topk_group=1, rope_parameters=KIMI_YARN, routed_scaling_factor=2.827)
    em, _ = assert_matches_transformers(tmp_path, build(cfg), model_type="kimi_k2")
    assert em.config.model_type == "kimi_k2" and em.config.moe.n_group == 1
    assert_groups_and_bias_matter(em, cfg)


def assert_groups_and_bias_matter(em, cfg):
    """On the tokens the test runs, the group limit and the correction bias each change which
    experts some token gets: the variants route differently, not only in name."""
    blocks = dict(em.moe_blocks())
    grouped = cfg.topk_group < cfg.n_group
    changed_by_groups = changed_by_bias = False
    for layer, (x, ids, _) in record_routing(em, tokens()).items():
        gate = blocks[layer].gate
        logits = linear(x.float(), gate.weight.float())
        k, bias = cfg.num_experts_per_tok, gate.e_score_correction_bias

        def route(b, n_group, topk_group):
            return (
                sigmoid_grouped_topk(logits, b, k, n_group, topk_group, cfg.norm_topk_prob, cfg.routed_scaling_factor)[
                    0
                ]
                .sort(-1)
                .values
            )

        assert torch.equal(ids.sort(-1).values, route(bias, cfg.n_group, cfg.topk_group))
        changed_by_groups |= not torch.equal(route(bias, 1, 1), route(bias, cfg.n_group, cfg.topk_group))
        changed_by_bias |= not torch.equal(
            route(torch.zeros_like(bias), cfg.n_group, cfg.topk_group), route(bias, cfg.n_group, cfg.topk_group)
        )
    assert changed_by_bias
    assert changed_by_groups == grouped


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("tied", [False, True])
def test_parameter_names_are_the_layout_names(family, tied):
    """The model's state_dict is exactly the family layout: same names, same shapes."""
    cfg = qwen(tie_word_embeddings=tied) if family == "qwen3_moe" else deepseek(tie_word_embeddings=tied)
    c = parse_hf_config(cfg.to_dict())
    with torch.device("meta"):
        model = model_class(c)(c)
    want = {s.name: s.shape for s in reader_for(c.model_type, "test").layout(c).specs}
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == want


def test_expert_range_loads_only_those_rows_and_an_ep_dispatcher_recombines(tmp_path):
    """Two halves of the experts loaded separately, joined by a dispatcher written here the way an
    expert-parallel one works (each half runs the rows routed to it), give the full model's logits."""
    ck = to_eprt(tmp_path, build(deepseek()))
    full = eprt.load_model(ck, dtype=torch.float32)
    lo = eprt.load_model(ck, dtype=torch.float32, expert_range=(0, 4))
    hi = eprt.load_model(ck, dtype=torch.float32, expert_range=(4, 4))
    w13 = Checkpoint(ck).read("model.layers.1.mlp.experts.w13")
    assert torch.equal(hi.model.layers[1].mlp.experts.w13, w13[4:8])
    assert hi.model.layers[1].mlp.experts.first == 4 and hi.model.layers[1].mlp.experts.num_experts == 8
    with pytest.raises(ConfigError, match="set_dispatcher"):
        hi(tokens())

    others = {layer: block.experts for layer, block in hi.moe_blocks()}

    def make(layer, block):
        def dispatch(x_TD, topk_ids_TK, topk_weights_TK, experts):
            out = torch.zeros(x_TD.shape, dtype=torch.float32)
            for ex in (experts, others[layer]):
                mine = (topk_ids_TK >= ex.first) & (topk_ids_TK < ex.first + ex.count)
                # rows of other ranks' experts run here on local expert 0 with weight 0
                local_ids = torch.where(mine, topk_ids_TK - ex.first, 0)
                x_sorted, tokens_per_expert, order = permute(x_TD, local_ids, ex.count)
                out += combine(ex(x_sorted, tokens_per_expert), order, torch.where(mine, topk_weights_TK, 0.0))
            return out

        return dispatch

    lo.set_dispatcher(make)
    with torch.no_grad():
        torch.testing.assert_close(lo(tokens()), full(tokens()), rtol=1e-5, atol=1e-6)


def test_bad_expert_range_is_refused(tmp_path):
    ck = to_eprt(tmp_path, build(qwen()))
    with pytest.raises(ConfigError, match="outside"):
        eprt.load_model(ck, expert_range=(6, 4))


def transformers_routing(m) -> dict[int, torch.Tensor]:
    """Hooks that record the expert ids transformers' routers choose, by layer."""
    seen = {}
    for i, layer in enumerate(m.model.layers):
        if hasattr(layer.mlp, "gate"):
            layer.mlp.gate.register_forward_hook(lambda mod, inp, out, i=i: seen.__setitem__(i, out[2]))
    return seen


@pytest.mark.parametrize(
    "cfg", [qwen(norm_topk_prob=True), deepseek(rope_parameters=YARN)], ids=["qwen3_moe", "deepseek_v3"]
)
def test_bf16_logits_close_to_transformers_bf16(tmp_path, cfg):
    """bf16 keeps 8 significant bits: neighbouring values are 2^-8 to 2^-7 of their magnitude
    apart. eprt rounds where transformers rounds, except that it sums a token's k weighted expert
    outputs in fp32 and rounds once, where Qwen3's reference rounds each product to bf16 first.
    Measured on ten seeds of these configs (2 x 16 tokens), wherever routing agrees:
    max|eprt - transformers| / max|logit| <= 0.008 for Qwen3 (about one bf16 step), and 0 for
    DeepSeek-V3 (fp32 router and fp32 sum, like its reference); bf16 itself lands 0.007-0.39 of
    the largest logit away from fp32. Bound: 2^-6 of the largest logit, twice the worst seen.

    A routing decision can still differ: an exact tie of bf16 router logits (eprt gives it to the
    lower expert id, torch.topk leaves it open) or a near-tie that a last-bit difference tips.
    A changed decision at token t moves every later token of that sequence, so the bound applies
    to the positions before the first such token, and few decisions may differ at all."""
    m = build(cfg)
    ck = to_eprt(tmp_path, m)
    ref = type(m).from_pretrained(tmp_path / "hf", dtype=torch.bfloat16).eval()
    em = eprt.load_model(ck, dtype=torch.bfloat16)
    ids = tokens(2, 16)
    want_routes = transformers_routing(ref)
    with torch.no_grad():
        want = ref(ids).logits.float()
        got = em(ids).float()
    got_routes = record_routing(em, ids)
    B, T = ids.shape
    first_change = torch.full((B,), T)
    decisions = changed = 0
    for layer, (_, topk_ids, _) in got_routes.items():
        differs = (topk_ids.sort(-1).values != want_routes[layer].sort(-1).values).any(-1).view(B, T)
        decisions += differs.numel()
        changed += int(differs.sum())
        for b in range(B):
            if differs[b].any():
                first_change[b] = min(first_change[b], int(differs[b].nonzero()[0]))
    assert changed <= 0.05 * decisions
    assert first_change.sum() >= B * T // 2, "routing changed too early to compare the logits"
    bound = 2**-6 * want.abs().max()
    for b in range(B):
        t = int(first_change[b])
        if t:
            assert (got[b, :t] - want[b, :t]).abs().max() <= bound
