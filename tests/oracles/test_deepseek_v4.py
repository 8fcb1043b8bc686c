"""DeepSeek-V4 (`deepseek_v4`): logits equal transformers' DeepseekV4ForCausalLM (fp32, relative max
error at most 1e-4) with every piece on (hyper-connected streams, sliding-window, CSA and HCA layers
with their compressors and the indexer, sinks, the grouped output projection, hash-routed and
sqrt(softplus)-routed experts clamped at swiglu_limit, the shared expert) over several dims, read
from transformers' save_pretrained; both config spellings read alike; what eprt refuses is refused
by name; the hash layers route each token to its row of tid2eid."""

import copy
import json
from dataclasses import replace

import pytest
import torch

transformers = pytest.importorskip("transformers")

import eprt  # noqa: E402
from eprt.errors import ConfigError  # noqa: E402
from eprt.families import parse_hf_config, reader_for  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.loading.resolved import ResolvedCheckpoint  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.loop.engine import LayerEngine  # noqa: E402
from eprt.quant.run.memory_plan import RunShape  # noqa: E402
from eprt.quant.run.planner import Planner  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402
from eprt.testing.tiny import make_tiny, tiny_config  # noqa: E402
from tests.ep_checks import same_files  # noqa: E402
from tests.oracles.test_models import record_routing  # noqa: E402

# (config.json overrides of the tiny release config, tokens): each case has every layer kind and
# more tokens than the sliding window and several compressed entries; index heads enough that no
# two index scores tie at 0 (transformers' topk breaks ties its own way)
CASES = {
    "release_spelling": ({"index_n_heads": 16}, 40),
    "transformers_spelling_wide": (
        {
            "num_hidden_layers": 5,
            "layer_types": [
                "heavily_compressed_attention",
                "compressed_sparse_attention",
                "sliding_attention",
                "compressed_sparse_attention",
                "heavily_compressed_attention",
            ],
            "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe"],
            "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
            "num_attention_heads": 8,
            "o_groups": 4,
            "o_lora_rank": 8,
            "qk_rope_head_dim": 16,
            "hc_mult": 4,
            "hc_sinkhorn_iters": 20,
            "index_n_heads": 16,
            "index_topk": 3,
            "index_head_dim": 24,
            "sliding_window": 6,
            "num_experts_per_tok": 3,
            "routed_scaling_factor": 2.5,
            "swiglu_limit": 0.5,
        },
        48,
    ),
    "shorter_than_a_window": ({"index_n_heads": 8}, 3),
}
SPELLING = ("compress_ratios", "num_hash_layers", "compress_rate_hca")


def transformers_model(overrides: dict, seed: int = 0):
    """transformers' model of the tiny config with `overrides`, weights random at scales that make
    every piece count (a small init leaves the streams' mixes uniform and the routers tied)."""
    hf = {**tiny_config("deepseek_v4"), **overrides}
    if "layer_types" in overrides:
        hf = {k: v for k, v in hf.items() if k not in SPELLING}
    cfg = transformers.AutoConfig.for_model(**copy.deepcopy(hf))  # it writes into the nested RoPE dicts
    torch.manual_seed(seed)
    m = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, t in m.state_dict().items():
        if not t.is_floating_point():  # tid2eid: distinct experts per token
            E = cfg.n_routed_experts
            state[name] = torch.rand(t.shape[0], E, generator=g).argsort(-1)[:, : t.shape[1]]
        else:
            centre = 1.0 if "norm" in name or name.endswith("scale") else 0.0
            state[name] = centre + torch.randn(t.shape, generator=g) * (0.3 if t.dim() > 1 else 0.5)
    m.load_state_dict(state)
    return m, hf


def to_eprt(tmp_path, m):
    m.save_pretrained(tmp_path / "hf")
    return convert_hf(str(tmp_path / "hf"), str(tmp_path / "ck"), progress=False)


def assert_close_relative(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape and got.dtype == torch.float32
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-4, err


@pytest.mark.parametrize("case", CASES)
def test_deepseek_v4_logits(tmp_path, case):
    overrides, T = CASES[case]
    m, hf = transformers_model(overrides)
    em = eprt.load_model(to_eprt(tmp_path, m), dtype=torch.float32)
    ids = torch.randint(0, hf["vocab_size"], (2, T), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want, got = m(ids).logits, em(ids)
    assert_close_relative(got, want)


def test_the_hash_layers_route_each_token_by_its_row_of_tid2eid(tmp_path):
    m, hf = transformers_model({"index_n_heads": 16})
    em = eprt.load_model(to_eprt(tmp_path, m), dtype=torch.float32)
    ids = torch.randint(0, hf["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(2))
    seen = record_routing(em, ids)
    table = m.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(seen[0][1], table[ids.reshape(-1)])
    assert not torch.equal(seen[1][1].sort(-1).values, table[ids.reshape(-1)].sort(-1).values)


def test_both_spellings_read_alike(tmp_path):
    m, hf = transformers_model({})
    m.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    released, as_saved = parse_hf_config(hf), parse_hf_config(saved)
    assert released.own.transformers_names is False and as_saved.own.transformers_names is True
    assert replace(as_saved, own=replace(as_saved.own, transformers_names=False)) == released


def test_the_model_holds_exactly_the_layout(tmp_path):
    c = parse_hf_config(tiny_config("deepseek_v4"))
    family = reader_for("deepseek_v4", "test")
    with torch.device("meta"):
        held = {n: tuple(t.shape) for n, t in family.model(c).state_dict().items()}
    assert held == {s.name: s.shape for s in family.layout(c).specs}


@pytest.mark.parametrize(
    "overrides, named",
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"scoring_func": "softmax"}, "scoring_func"),
        ({"compress_ratios": [0, 4, 7, 4]}, "compress_ratios"),
        ({"compress_ratios": [0, 4, 128, 4, 0, 4], "num_nextn_predict_layers": 2}, "MTP layers different"),
        ({"n_shared_experts": 2}, "n_shared_experts"),
        ({"o_groups": 3}, "o_groups"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_what_eprt_does_not_run_is_refused_by_name(overrides, named):
    with pytest.raises(ConfigError, match=named):
        parse_hf_config({**tiny_config("deepseek_v4"), **overrides}, "config.json")


def test_the_memory_plan_counts_every_residual_stream_and_the_token_ids(tmp_path):
    """A rank's hidden states hold, per sequence, hc_mult streams of T x D and its T token ids (int64,
    which the hash layers read): twice the streams, twice the stream bytes."""
    shape = RunShape(1, 4, 2, num_sequences=64, seq_len=24, step_sequences=8, group_tokens=48)
    hidden = {}
    for streams in (2, 4):
        hf = make_tiny("deepseek_v4", str(tmp_path / f"hf{streams}"), hc_mult=streams)
        with Checkpoint(convert_hf(hf, str(tmp_path / f"ck{streams}"), progress=False)) as ck:
            planner = Planner.of(ResolvedCheckpoint.of(ck, torch.float32), torch.device("cpu"))
            hidden[streams] = planner.plan(shape, 0).hidden
    per_stream = 16 * 24 * 64 * 4  # rank 1 of 4 holds 16 of the 64 sequences, fp32
    assert hidden[2] == 2 * per_stream + 16 * 24 * 8 and hidden[4] - hidden[2] == 2 * per_stream


def test_a_run_stopped_after_the_hash_layers_resumes_to_the_same_export(tmp_path, monkeypatch):
    """The token ids ride with the hidden states in the work directory: a run stopped after layer 1
    (the second layer routes by hash in this config) resumes to the same bytes as a whole run."""
    hf = make_tiny("deepseek_v4", str(tmp_path / "hf"), num_hash_layers=3)
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    state = ParallelState.single("cpu")

    def args(out: str, **kw) -> PTQArgs:
        return PTQArgs(ck, "nvfp4", out, calib_size=4, seq_len=12, eval_size=0, progress=False, **kw)

    whole, out = str(tmp_path / "whole"), str(tmp_path / "q")
    run_ptq(state, args(whole))
    run_layer = LayerEngine.run_layer

    def stopping(self, i, ls, pb):
        if i == 2:
            raise RuntimeError("stopped")
        return run_layer(self, i, ls, pb)

    with monkeypatch.context() as m:
        m.setattr(LayerEngine, "run_layer", stopping)
        with pytest.raises(Exception, match="stopped"):
            run_ptq(state, args(out))
    assert run_ptq(state, args(out, resume=True))["resumed_after"] == 1
    for d in (whole, out):
        export_hf(d, d + "-hf", progress=False)
    assert same_files(whole + "-hf", out + "-hf")
