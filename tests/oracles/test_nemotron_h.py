"""Nemotron-H / Nemotron-3 (`nemotron_h`) and Nemotron-H-Omni's language model (`nemotron_h_omni`):
logits equal transformers' NemotronHForCausalLM / NemotronH_Omni_Reasoning_V3 (fp32) with every
piece on and off (Mamba-2 over several chunks and a partial one, time-step limits, conv without a
bias, attention without positions, relu² MLP, grouped sigmoid routing, the latent MoE) at several
dims; the export gives back every source tensor byte for byte (the Omni's towers too); the
release's spelling of the config reads as transformers'; what eprt does not run is refused by name;
the rotation runs where nothing carried reads the stream."""

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import eprt
from eprt.errors import ConfigError
from eprt.families import parse_hf_config
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.loading.loader import load_parallel
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.models.mamba2 import ssd_scan
from eprt.parallel import ParallelState
from eprt.quant.rotation.rotated import RotatedCheckpoint
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny, tiny_config
from tests.hf_utils import read_hf_tensors
from tests.test_awq import assert_same_logits

# an oracle of the tests, skipped by name where it is not installed
transformers = pytest.importorskip("transformers")

from tests.oracles.test_models import VOCAB, assert_logits_and_carried  # noqa: E402

M, E, A, P = "linear_attention", "moe", "full_attention", "mlp"
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=48,
    mamba_num_heads=4,
    mamba_head_dim=8,
    ssm_state_size=8,
    n_groups=2,
    n_routed_experts=8,
    moe_intermediate_size=16,
    moe_shared_expert_intermediate_size=24,
    num_experts_per_tok=2,
    chunk_size=5,
    initializer_range=0.1,
)
CASES = {
    # Nano: Mamba, MoE, attention and MLP layers; experts in 2 groups, the best one kept; 12 tokens
    # make two whole chunks of 5 and a partial one
    "nano_like": dict(layers_block_type=[M, E, A, P, M, E], n_group=2, topk_group=1),
    # Super/Ultra: the latent MoE; clamped time steps, unnormalized scaled weights, other dims
    "super_like": dict(
        layers_block_type=[M, E, M, A, E],
        moe_latent_size=16,
        time_step_limit=[0.01, 0.5],
        norm_topk_prob=False,
        routed_scaling_factor=2.5,
        hidden_size=48,
        mamba_num_heads=8,
        mamba_head_dim=4,
        n_groups=4,
        chunk_size=3,
        conv_kernel=3,
        use_conv_bias=False,
        num_attention_heads=6,
        num_key_value_heads=3,
    ),
    # one chunk holds the whole sequence; a single group of B and C; no MoE layer at all
    "dense_one_chunk": dict(layers_block_type=[M, P, A, M], n_groups=1, chunk_size=64),
}
T = 12


def spread(model) -> None:
    """Routers far from ties, decays and time steps across their range, norms away from 1."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.normal_(0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                p.normal_(0, 0.1)
            elif name.endswith("A_log"):
                p.uniform_(0, 2)
            elif name.endswith("dt_bias"):
                p.normal_(0, 1)
            elif name.endswith((".D", "norm.weight", "norm_f.weight")):
                p.normal_(1, 0.3)
            elif name.endswith("conv1d.bias"):
                p.normal_(0, 0.2)


def built(case: str):
    torch.manual_seed(0)
    m = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{**BASE, **CASES[case]})).eval()
    spread(m)
    return m


@pytest.mark.parametrize("case", CASES)
def test_logits_match_transformers_and_the_export_gives_back_the_source(tmp_path, case):
    m = built(case)
    m.save_pretrained(tmp_path / "hf")
    moe_layers = [i for i, k in enumerate(m.config.layers_block_type) if k == E]
    assert_logits_and_carried(tmp_path, m, "nemotron_h", moe_layers, T, carried=("backbone.", "lm_head."))


def test_the_omni_language_model_matches_and_its_towers_travel_unchanged(tmp_path):
    omni = {k: v for k, v in tiny_config("nemotron_h_omni").items() if k != "torch_dtype"}  # an fp32 oracle
    cfg = transformers.AutoConfig.for_model(**{**omni, "llm_config": {**BASE, **CASES["super_like"]}})
    torch.manual_seed(0)
    m = transformers.AutoModelForImageTextToText.from_config(cfg).eval()
    spread(m)
    m.save_pretrained(tmp_path / "hf")
    carried = ("vision_model.", "mlp1.", "vision_projector.")
    assert_logits_and_carried(tmp_path, m, "nemotron_h_omni", [1, 4], T, carried)


def test_the_release_spelling_reads_as_transformers_saves_it():
    """hybrid_override_pattern and mamba_* names (the release, transformers 4) give the config
    layers_block_type and the plain names (transformers 5) give."""
    five = dict(BASE, layers_block_type=[M, E, A, P], conv_kernel=3, chunk_size=7, n_groups=1, model_type="nemotron_h")
    release = {k: v for k, v in five.items() if k not in ("layers_block_type", "conv_kernel", "chunk_size", "n_groups")}
    release.update(hybrid_override_pattern="ME*-", mamba_d_conv=3, mamba_chunk_size=7, mamba_n_groups=1)
    legacy_names = dict(five, layers_block_type=["mamba", "moe", "attention", "mlp"])
    got = parse_hf_config(five, "five")
    assert parse_hf_config(release, "release") == got == parse_hf_config(legacy_names, "legacy")
    assert got.own.layer_kinds == (M, E, A, P) and got.own.mamba.conv_kernel == 3 and got.own.mamba.chunk_size == 7
    assert got.moe_layers == (1,) and got.rope is None


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(mlp_bias=True), "mlp_bias"),
        (dict(use_bias=True), "use_bias"),
        (dict(mlp_hidden_act="silu"), "mlp_hidden_act"),
        (dict(hybrid_override_pattern="ME?-"), "hybrid_override_pattern"),
        (dict(layers_block_type=[M, "conv"]), "layers_block_type"),
        (dict(mamba_num_heads=3), "mamba_num_heads 3 is not a multiple of n_groups"),
        (dict(time_step_limit=[0.5, 0.1]), "time_step_limit"),
        (dict(n_shared_experts=2), "n_shared_experts"),
    ],
)
def test_what_eprt_does_not_run_is_refused_by_name(change, named):
    hf = {**tiny_config("nemotron_h"), **change}
    if "layers_block_type" in change:
        hf.pop("hybrid_override_pattern")
    with pytest.raises(ConfigError, match=named):
        parse_hf_config(hf, "config.json")


def test_the_chunked_scan_is_the_step_by_step_recurrence():
    """The scan chunk by chunk (memory bounded by the chunk) is the recurrence one step at a time:
    state = exp(dt A) state + dt x B^T, y = state C, at any chunk size, a partial last chunk included;
    B and C shared by each group of heads (here 2 groups of 3)."""
    g = torch.Generator().manual_seed(0)
    Bsz, L, H, Pd, N, G = 2, 11, 6, 4, 5, 2
    x = torch.randn(Bsz, L, H, Pd, generator=g, dtype=torch.float64)
    B_grouped, C_grouped = (torch.randn(Bsz, L, G, N, generator=g, dtype=torch.float64) for _ in "BC")
    B, C = (m.repeat_interleave(H // G, dim=2) for m in (B_grouped, C_grouped))
    dt = torch.rand(Bsz, L, H, generator=g, dtype=torch.float64) * 0.5
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 2
    state, want = torch.zeros(Bsz, H, Pd, N, dtype=torch.float64), []
    for t in range(L):
        decay = torch.exp(dt[:, t] * A)[..., None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * B[:, t, :, None, :]
        want.append(torch.einsum("bhpn,bhn->bhp", state, C[:, t]))
    want = torch.stack(want, dim=1)
    for chunk in (1, 4, 11, 16):
        torch.testing.assert_close(ssd_scan(x, dt, A, B_grouped, C_grouped, chunk), want, rtol=1e-10, atol=1e-10)


def test_the_rotated_model_computes_the_same_where_nothing_carried_reads_the_stream(tmp_path):
    """Without the carried MTP layers (which the rotation refuses by name, tests/test_rotation.py),
    Mamba's in_proj and out_proj, the relu² MLPs and the latent projections rotate, each Mamba
    mixer's scan left unrotated by name: the fp32 logits are the original's."""
    hf = make_tiny("nemotron_h", str(tmp_path / "hf"), num_nextn_predict_layers=0)
    ck_dir = convert_hf(hf, str(tmp_path / "ck"), dtype="fp32", progress=False)
    ids = torch.randint(0, 500, (2, 20), generator=torch.Generator().manual_seed(1))
    state = ParallelState.single()
    with Checkpoint(ck_dir) as ck:
        rotated = RotatedCheckpoint(ck)
        model = load_parallel(ResolvedCheckpoint.of(ck, torch.float32), state)
        assert_same_logits(
            model, load_parallel(ResolvedCheckpoint.of(rotated, torch.float32), state), ids, "nemotron_h"
        )
        assert any("backbone.layers.0.mixer: values left unrotated (a gated norm" in s for s in rotated.plan.left_out)
        for name in ("backbone.layers.1.mixer.fc1_latent_proj.weight", "backbone.layers.0.mixer.in_proj.weight"):
            assert name in rotated.plan.steps
        assert "backbone.layers.1.mixer.experts.w1" not in rotated.plan.steps  # the latent is not rotated


def test_make_tiny_writes_the_releases_names(tmp_path):
    """eprt-make-tiny nemotron_h: the release's names, the MTP layers among them, experts per expert."""
    hf = make_tiny("nemotron_h", str(tmp_path / "hf"))
    names = set(read_hf_tensors(hf))
    assert {"backbone.embeddings.weight", "backbone.norm_f.weight", "lm_head.weight"} <= names
    assert {"mtp.layers.0.eh_proj.weight", "mtp.layers.1.final_layernorm.weight"} <= names
    assert "backbone.layers.1.mixer.experts.7.up_proj.weight" in names and "backbone.embed_tokens.weight" not in names
    em = eprt.load_model(convert_hf(hf, str(tmp_path / "ck"), progress=False), dtype=torch.float32)
    assert [i for i, _ in em.moe_blocks()] == [1, 4]


def test_eprt_check_refuses_a_quantized_router_which_the_engines_build_unquantized(tmp_path):
    """An FP8 export passes eprt-check; the same export with the router's weight in FP8 beside its
    scales (as a tool quantizing every Linear writes it) is refused, naming the router, with and
    without the source: vLLM builds Nemotron-H's router (GateLinear) unquantized."""
    hf = make_tiny("nemotron_h", str(tmp_path / "hf"), num_nextn_predict_layers=0)
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, "fp8", q, calib_size=2, seq_len=16, eval_size=0, progress=False))
    out = Path(export_hf(q, q + "-hf", progress=False))
    assert check_export(str(out), hf) == []
    router = "backbone.layers.1.mixer.gate"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = out / index["weight_map"][f"{router}.weight"]
    held = load_file(shard)
    scale = held[f"{router}.weight"].float().abs().amax() / 448
    held[f"{router}.weight"] = (held[f"{router}.weight"].float() / scale).to(torch.float8_e4m3fn)
    held[f"{router}.weight_scale"], held[f"{router}.input_scale"] = scale, torch.tensor(1.0)
    save_file(held, shard)
    for name in ("weight_scale", "input_scale"):
        index["weight_map"][f"{router}.{name}"] = index["weight_map"][f"{router}.weight"]
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    for source in (hf, None):
        problems = check_export(str(out), source)
        assert any(p.startswith(f"{router}.weight: quantized, but the engines build") for p in problems), problems
