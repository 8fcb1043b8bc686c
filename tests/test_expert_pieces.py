"""Experts of every shape the families need compute what their reference computes: eprt's
`Experts` built from the pieces (gated or not, biases, the activation) against transformers' own
per-expert loops (GPT-OSS: biased, clamped SwiGLU, stored transposed and interleaved; Nemotron-H:
not gated, relu^2), with the weights read through the layout's storage; the work-unit kernel
against the grouped one, each unit computed as if alone, on the CPU fallback and on Triton."""

import pytest
import torch

import eprt.kernels.grouped_gemm
from eprt.errors import ConfigError
from eprt.kernels import combine, permute
from eprt.kernels.grouped_gemm import unit_act, unit_mlp
from eprt.layout import ClampedSwiGLU, ExpertPieces, ExpertStorage, stacked_experts
from eprt.models.moe import Experts

transformers = pytest.importorskip("transformers")  # the oracle, skipped by name where it is not installed

E, I, H, T, K = 4, 12, 16, 24, 2
GPT_OSS = ExpertPieces(bias=True, activation=ClampedSwiGLU(alpha=1.702, limit=7.0))
NEMOTRON_H = ExpertPieces(gated=False, activation="relu2")


def gpt_oss_experts(g: torch.Generator):
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=K)
    ref = GptOssExperts(cfg)
    storage = ExpertStorage(fused=("gate_up_proj", "down_proj"), transposed=True, interleaved=True)
    return ref, GPT_OSS, storage, lambda x, ids, w: ref(x, router_indices=ids, routing_weights=w)


def nemotron_h_experts(g: torch.Generator):
    from transformers import NemotronHConfig
    from transformers.models.nemotron_h.modeling_nemotron_h import NemotronHExperts

    cfg = NemotronHConfig(
        hidden_size=H, moe_intermediate_size=I, n_routed_experts=E, num_experts_per_tok=K, mlp_hidden_act="relu2"
    )
    ref = NemotronHExperts(cfg)
    storage = ExpertStorage.named(None, "up_proj", "down_proj")
    return ref, NEMOTRON_H, storage, lambda x, ids, w: ref(x, ids, w)


ORACLES = {"gpt_oss": gpt_oss_experts, "nemotron_h": nemotron_h_experts}


def eprt_experts(ref: torch.nn.Module, pieces: ExpertPieces, storage: ExpertStorage) -> Experts:
    """eprt's experts holding the reference's weights, each read through its layout spec."""
    experts = Experts(E, 0, E, H, I, pieces=pieces)
    params = dict(experts.named_parameters())
    for spec in stacked_experts("x", E, I, H, pieces=pieces, storage=storage):
        fused = ref.get_parameter(spec.fused.removeprefix("x."))
        params[spec.name.removeprefix("x.")].data = spec.from_fused(fused.data).contiguous()
    assert set(params) == {s.name.removeprefix("x.") for s in stacked_experts("x", E, I, H, pieces=pieces)}
    return experts


@pytest.mark.parametrize("family", ORACLES)
def test_experts_from_their_pieces_compute_the_references_loop(family):
    g = torch.Generator().manual_seed(0)
    ref, pieces, storage, run_ref = ORACLES[family](g)
    for p in ref.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5  # outputs beyond the clamp limit too
    experts = eprt_experts(ref, pieces, storage)
    x = torch.randn(T, H, generator=g) * 2
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    with torch.no_grad():
        want = run_ref(x, ids, w)
        x_sorted, tokens, order = permute(x, ids, E)
        got = combine(experts(x_sorted, tokens), order, w)
        units = torch.stack([tokens // 2, tokens - tokens // 2], dim=1)  # two work units per expert
        by_units = combine(experts.forward_units(x_sorted, units), order, w)
    if family == "gpt_oss":  # the clamp is reached, so the test sees it
        assert (experts.w_in.detach()[0] @ x.T).abs().max() > 7
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(by_units, want, rtol=1e-5, atol=1e-5)


def units_problem(family: str):
    g = torch.Generator().manual_seed(1)
    ref, pieces, storage, _ = ORACLES[family](g)
    for p in ref.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    counts = torch.tensor([[4, 0, 3], [0, 0, 0], [9, 6, 1], [2, 2, 2]])
    return eprt_experts(ref, pieces, storage), counts, torch.randn(int(counts.sum()), H, generator=g)


def run_units(ex: Experts, x: torch.Tensor, counts: torch.Tensor, e: slice = slice(None)):
    """unit_mlp over the experts `e` of `ex`: (h, y)."""
    b_in, b_out = (None if b is None else b[e] for b in (ex.b_in, ex.b_out))
    with torch.no_grad():
        return unit_mlp(x, ex.w_in[e], ex.w_out[e], ex.act, counts, gated=ex.pieces.gated, b_in=b_in, b_out=b_out)


@pytest.mark.parametrize("family", ORACLES)
def test_a_work_unit_of_any_pieces_computes_as_if_alone(family):
    """Each (expert, unit) block's h and y are the bits of its rows alone, biases and activation
    included, and unit_act gives the bits unit_mlp gives."""
    ex, counts, x = units_problem(family)
    h, y = run_units(ex, x, counts)
    a = 0
    for (e, u), n in zip(((e, u) for e in range(E) for u in range(3)), counts.flatten().tolist()):
        h_alone, y_alone = run_units(ex, x[a : a + n].clone(), torch.tensor([[n]]), slice(e, e + 1))
        assert torch.equal(h[a : a + n], h_alone) and torch.equal(y[a : a + n], y_alone), (e, u)
        if n:
            b_in = None if ex.b_in is None else ex.b_in[e : e + 1]
            with torch.no_grad():
                h_act = unit_act(
                    x[a : a + n], ex.w_in[e : e + 1], ex.act, torch.tensor([n]), gated=ex.pieces.gated, b_in=b_in
                )
            assert torch.equal(h_act, h_alone), (e, u)
        a += n


@pytest.mark.parametrize("family", ORACLES)
def test_triton_units_of_any_pieces_match_the_fallback(family, monkeypatch):
    pytest.importorskip("triton")
    ex, counts, x = units_problem(family)
    want = run_units(ex, x, counts)
    monkeypatch.setattr(eprt.kernels.grouped_gemm, "use_triton", lambda x: True)
    got = run_units(ex, x, counts)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_an_activation_eprt_lacks_is_refused_by_name():
    with pytest.raises(ConfigError, match="ungated activation 'silu'"):
        Experts(E, 0, E, H, I, pieces=ExpertPieces(gated=False))


@pytest.mark.parametrize("family", ORACLES)
def test_every_expert_observed_over_all_rows_gets_its_own_activation(family):
    """--calibrate-all-experts' statistics pass: each expert's activation over every row is what the
    reference computes for that expert, bias and activation included."""
    g = torch.Generator().manual_seed(2)
    ref, pieces, storage, _ = ORACLES[family](g)
    for p in ref.parameters():
        p.data = torch.randn(p.shape, generator=g) * 0.5
    ex = eprt_experts(ref, pieces, storage)
    x = torch.randn(10, H, generator=g)
    seen = {}
    ex.taps.every_expert = lambda e, x_, h, rows: seen.setdefault(e, h)
    with torch.no_grad():
        ex.observe_every_expert(x, torch.tensor([6, 4]))
        for e in range(E):
            z = x @ ex.w_in[e].T + (0 if ex.b_in is None else ex.b_in[e])
            want = ex.act(*z.chunk(2, dim=-1)) if pieces.gated else ex.act(z)
            torch.testing.assert_close(seen[e], want, rtol=1e-5, atol=1e-5)
    assert sorted(seen) == list(range(E))
