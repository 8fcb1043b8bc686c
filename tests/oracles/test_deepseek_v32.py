"""DeepSeek-V3.2 (`deepseek_v32`): logits equal transformers' DeepseekV32ForCausalLM (fp32) at its
init on sequences longer than index_topk, where the lightning indexer masks keys (ties among its
scores to the lowest position, as DeepSeek's reference), and shorter ones, where it keeps every
key; both config spellings; expert-parallel logits equal the single-process ones;
PTQ exports are the same bytes at every (world, ep), with the indexer unquantized and excluded."""

import json
import re
from unittest import mock

import pytest
import torch

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import DeepseekV32Config, DeepseekV32ForCausalLM  # noqa: E402

import eprt  # noqa: E402
from eprt.families import model_class, parse_hf_config, reader_for  # noqa: E402
from eprt.hf.check_export import check_export  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.ep_checks import assert_ep_logits, assert_exports_layout_invariant, tiny_checkpoints  # noqa: E402
from tests.hf_utils import raw, read_hf_tensors  # noqa: E402
from tests.oracles.test_models import DEEPSEEK, YARN, assert_groups_and_bias_matter, build, to_eprt, tokens  # noqa: E402
from tests.test_compressed import (  # noqa: E402
    FP8_DEEPSEEK,
    assert_block_fp8_source_runs_decoded_and_exports_back,
    fp8_reference,
)

FAMILY = "deepseek_v32"
INDEXER = ("wq_b", "wk", "weights_proj")
LAYER0 = "model.layers.0.self_attn.indexer"


def v32(**kw) -> DeepseekV32Config:
    base = dict(DEEPSEEK, index_n_heads=8, index_head_dim=16, index_topk=4)
    return DeepseekV32Config(**{**base, **kw})


# torch's own topk, kept before a test patches it into the indexers
NATIVE_TOPK = torch.Tensor.topk


def lowest_position_topk(scores: torch.Tensor, k: int, dim: int = -1, **_) -> torch.return_types.topk:
    """torch.topk keeping, among scores equal to the k-th, the lowest positions: what DeepSeek's own
    inference code gets from torch.topk on CUDA, which gathers the values equal to the k-th in index
    order. On the CPU torch.topk takes them in no fixed order."""
    picked = torch.sort(scores, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((scores.gather(dim, picked), picked))


def logits_with_ties_to_the_lowest_position(m, ids) -> tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]:
    """transformers' logits with its indexers' topk as `lowest_position_topk`, and each indexer's
    scores [B, S, T] with its k. The routers' topk stays transformers' own."""
    index_scores = []

    def topk(scores, k, *args, **kwargs):
        index_scores.append((scores.clone(), k))
        return lowest_position_topk(scores, k, *args, **kwargs)

    for layer in m.model.layers:
        indexer = layer.self_attn.indexer
        if indexer is None:  # a layer sharing another's top-k (GLM-5)
            continue

        def forward(*args, _forward=indexer.forward, **kwargs):
            with mock.patch.object(torch.Tensor, "topk", topk):
                return _forward(*args, **kwargs)

        indexer.forward = forward
    with torch.no_grad():
        return m(ids).logits, index_scores


def keys_chosen_differently(index_scores: list[tuple[torch.Tensor, int]]) -> tuple[int, int]:
    """(keys transformers' own topk chooses differently from the lowest positions, queries that leave
    out a key tied with their k-th score) over the indexers' scores; asserts that every key chosen
    differently is tied with its query's k-th score."""
    differently = left_out_ties = 0
    for scores, k in index_scores:
        T = scores.shape[-1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        kth = scores.masked_fill(~causal, float("-inf")).sort(-1, descending=True).values[..., k - 1 : k]
        tied = (scores == kth) & causal

        def chosen(picked):
            return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, picked, True) & causal

        lowest, native = chosen(lowest_position_topk(scores, k).indices), chosen(NATIVE_TOPK(scores, k).indices)
        assert not ((lowest ^ native) & ~tied).any(), "a key chosen differently without a tie"
        differently += int((lowest ^ native).sum())
        left_out_ties += int((tied & ~lowest).any(-1).sum())
    return differently, left_out_ties


# (config, tokens, whether some query leaves out keys tied with its k-th score). Weights at
# transformers' init (std 0.02): with few index heads many keys score exactly 0 (every head's
# q . k <= 0), and the top k often ends inside those ties.
CASES = {
    "two_index_heads_top8": (dict(index_n_heads=2, index_topk=8), 37, True),
    "two_index_heads_groups_yarn": (dict(index_n_heads=2, n_group=2, topk_group=1, rope_parameters=YARN), 16, True),
    "eight_index_heads_top4": (dict(), 8, False),
    "groups_yarn": (dict(rope_parameters=YARN), 12, False),
    "two_shared_all_moe_tied": (
        dict(
            n_shared_experts=2,
            first_k_dense_replace=0,
            num_hidden_layers=2,
            tie_word_embeddings=True,
            norm_topk_prob=False,
            n_group=2,
            topk_group=1,
        ),
        12,
        False,
    ),
    "no_longer_than_index_topk": (dict(rope_parameters=YARN), 4, False),
}


@pytest.mark.parametrize("case", CASES)
def test_deepseek_v32_logits(tmp_path, case):
    """Longer than index_topk, the indexer masks all but index_topk earlier keys from the later
    queries: eprt's logits are transformers' once ties among the index scores go to the lowest
    position, as in DeepSeek's reference; transformers' own CPU topk differs only in which tied keys
    it keeps. No longer than index_topk, the indexer keeps every key, and the model is DeepSeek-V3's
    MLA (calibration prompts no longer than index_topk run dense attention)."""
    overrides, T, ties = CASES[case]
    cfg = v32(initializer_range=0.02, **overrides)
    m = build(cfg, cls=DeepseekV32ForCausalLM)
    em = eprt.load_model(to_eprt(tmp_path, m), dtype=torch.float32)
    ids = tokens(2, T)
    want, index_scores = logits_with_ties_to_the_lowest_position(m, ids)
    with torch.no_grad():
        got = em(ids)
        for layer in em.model.layers:
            layer.self_attn.indexer = None
        dense = em(ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    differently, left_out_ties = keys_chosen_differently(index_scores)
    assert (left_out_ties > 0) == ties, (differently, left_out_ties)
    if T > cfg.index_topk:
        assert not torch.allclose(dense, want, rtol=1e-3, atol=1e-3)  # the mask changes the logits
        assert_groups_and_bias_matter(eprt.load_model(str(tmp_path / "ck"), dtype=torch.float32), cfg)
    else:
        torch.testing.assert_close(dense, want, rtol=1e-4, atol=1e-5)
    assert [i for i, _ in em.moe_blocks()] == list(range(cfg.first_k_dense_replace, cfg.num_hidden_layers))


def test_the_transformers_4_spelling_reads_the_same():
    """The released config says first_k_dense_replace, rope_theta and rope_scaling; transformers 5
    writes mlp_layer_types and rope_parameters as well."""
    v5 = v32(first_k_dense_replace=2, rope_parameters=YARN).to_dict()
    assert v5["mlp_layer_types"] == ["dense", "dense", "sparse"]
    v4 = {k: v for k, v in v5.items() if k not in ("rope_parameters", "mlp_layer_types", "layer_types")}
    v4.update(rope_theta=YARN["rope_theta"], rope_scaling={k: v for k, v in YARN.items() if k != "rope_theta"})
    a, b = parse_hf_config(v5), parse_hf_config(v4)
    assert a == b and a.moe_layers == (2,) and a.indexer.topk == 4
    # transformers follows mlp_layer_types where it is written
    c = parse_hf_config({**v5, "mlp_layer_types": ["sparse", "dense", "sparse"]})
    assert c.moe_layers == (0, 2)


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"index_head_dim": 4}, "index_head_dim"),
        ({"mlp_layer_types": ["dense"]}, "mlp_layer_types"),
    ],
)
def test_settings_eprt_cannot_run_are_refused_by_name(bad, message):
    with pytest.raises(Exception, match=message):
        parse_hf_config({**v32().to_dict(), **bad})


def test_parameter_names_are_the_layout_names():
    c = parse_hf_config(v32().to_dict())
    with torch.device("meta"):
        model = model_class(c)(c)
    layout = reader_for(c.model_type, "test").layout(c)
    assert {n: tuple(t.shape) for n, t in model.state_dict().items()} == {s.name: s.shape for s in layout.specs}
    quantizable = layout.linear_modules()
    assert "model.layers.0.self_attn.q_b_proj" in quantizable
    assert not any(".indexer." in m for m in quantizable)


# GLM-5 (tests/oracles/test_glm_moe_dsa.py) is DeepSeek-V3.2 with index sharing: its tiny model's
# layer 2 runs no indexer and reuses layer 1's top-k
@pytest.fixture(scope="module", params=[FAMILY, "glm_moe_dsa"])
def tiny(tmp_path_factory, request):
    return tiny_checkpoints(tmp_path_factory.mktemp(request.param), request.param)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_equal_single_process(tiny, world, ep):
    # 9 tokens, index_topk 4: the indexer masks
    assert_ep_logits([tiny["fp32"][1]], world, ep, seq_len=9)


@pytest.mark.timeout(400)
def test_ptq_exports_are_the_same_bytes_at_every_layout_and_keep_the_indexer(tiny, tmp_path):
    """Every indexer of the decoder layers (those the model has: a GLM-5 layer that shares another's
    top-k has none) is excluded and exported as the source held it; MLA is quantized."""
    hf, ck = tiny["bf16"]
    refs = assert_exports_layout_invariant(ck, hf, str(tmp_path))
    source = read_hf_tensors(hf)
    decoder = json.load(open(f"{hf}/config.json"))["num_hidden_layers"]
    indexers = {
        n.rsplit(".", 1)[0]
        for n in source
        if re.fullmatch(rf"model\.layers\.\d+\.self_attn\.indexer\.({'|'.join(INDEXER)})\.weight", n)
    }
    indexers = {m for m in indexers if int(m.split(".")[2]) < decoder}
    assert len(indexers) == len(INDEXER) * len({m.split(".")[2] for m in indexers}) >= 2 * len(INDEXER)
    for recipe, out in refs.items():
        excluded = json.load(open(f"{out}/hf_quant_config.json"))["quantization"]["exclude_modules"]
        exported = read_hf_tensors(out)
        for module in sorted(indexers):
            assert any(module == e or (e.endswith("*") and module.startswith(e[:-1])) for e in excluded), (
                recipe,
                module,
            )
            assert raw(exported[f"{module}.weight"]) == raw(source[f"{module}.weight"]), (recipe, module)
            assert f"{module}.weight_scale" not in exported and f"{module}.input_scale" not in exported
        for layer in range(decoder):
            assert f"model.layers.{layer}.self_attn.q_b_proj.weight_scale" in exported, recipe


@pytest.mark.parametrize("family", [FAMILY, "glm_moe_dsa"])
def test_block_fp8_source_runs_decoded_and_exports_back(tmp_path, family):
    """DeepSeek-V3.2 and GLM-5 ship block FP8 like DeepSeek-V3 (the indexer's wq_b and wk too, its
    weights_proj in bf16): it stays encoded, runs as if decoded ahead of time, exports back byte for
    byte; a quantized export writes the indexer decoded to bf16 and excluded, the way the engines
    load it."""
    hf = make_tiny(family, str(tmp_path / "fp8-hf"), source_format="fp8-block", **FP8_DEEPSEEK)
    source = read_hf_tensors(hf)
    assert f"{LAYER0}.wk.weight_scale_inv" in source and f"{LAYER0}.weights_proj.weight_scale_inv" not in source
    ck = assert_block_fp8_source_runs_decoded_and_exports_back(hf, tmp_path)

    run_ptq(
        ParallelState.single(),
        PTQArgs(ck, "nvfp4", str(tmp_path / "q"), calib_size=2, seq_len=16, batch_size=2, dtype="bf16", progress=False),
    )
    out = export_hf(str(tmp_path / "q"), str(tmp_path / "x"), progress=False)
    assert check_export(out, hf) == []
    got, want = read_hf_tensors(out), fp8_reference(hf)
    for proj in ("wq_b", "wk"):
        name = f"{LAYER0}.{proj}.weight"
        assert got[name].dtype == torch.bfloat16 and torch.equal(got[name], want[name]), name
    assert raw(got[f"{LAYER0}.weights_proj.weight"]) == raw(source[f"{LAYER0}.weights_proj.weight"])
    assert got["model.layers.0.self_attn.q_b_proj.weight"].dtype == torch.uint8  # NVFP4 from the decoded weight
