"""Nemotron-H's multi-token-prediction step (eprt.families.nemotron_h.mtp), built from the tensors
convert carries through. transformers has no MTP for this family: the oracle is transformers' own
NemotronH blocks (`NemotronHBlock`, attention then MoE, loaded with the step's `mtp.layers.K`
weights) composed as vLLM's nemotron_h_mtp.py composes them: the first layer's input
`eh_proj(cat(enorm(embed(token[t + 1])), hnorm(norm_f(h[t]))))`, the layers one after the other
under the pre-norm residual rule, `final_layernorm` on the last one's output. Then the engine
calibrates the step as one forward of the whole batch through it does, and a recipe with
`mtp: true` exports it quantized."""

import json
import os
import re
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load_file

from eprt.errors import ConfigError
from eprt.families import parse_hf_config
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.loading.loader import load_mtp
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.models.decoder import LayerContext
from eprt.parallel import ParallelState
from eprt.quant.run.planner import Planner
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny, tiny_config
from tests.ep_checks import same_files
from tests.hf_utils import read_hf_tensors
from tests.mtp_checks import assert_the_engine_calibrates_mtp_as_one_forward
from tests.multiproc import free_port, run_world

# an oracle of the tests, skipped by name where it is not installed
transformers = pytest.importorskip("transformers")

EPS = 1e-5  # the tiny config's layer_norm_epsilon
MTP = "mtp.layers."
RECIPE = "nvfp4_experts_fp8_attention_mtp"
CALIB = dict(kv_cache="fp8", calib_size=6, seq_len=16, batch_size=2, progress=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("nemotron_mtp")
    hf = make_tiny("nemotron_h", str(d / "hf"), dtype="fp32")
    return hf, convert_hf(hf, str(d / "ck"), progress=False)


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def transformers_blocks(hf: str, t: dict) -> list[torch.nn.Module]:
    """transformers' NemotronH of the step's layer kinds (attention, MoE) as its decoder layers,
    holding the step's `mtp.layers.K` weights (the routed experts stacked as transformers holds them)."""
    cfg = json.load(open(os.path.join(hf, "config.json")))
    kinds = cfg.pop("mtp_hybrid_override_pattern")
    cfg.update(hybrid_override_pattern=kinds, num_hidden_layers=len(kinds), num_nextn_predict_layers=0)
    m = transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**cfg)).eval()
    state = {}
    for name, w in t.items():
        if m_ := re.fullmatch(r"mtp\.layers\.(\d+)\.((norm|mixer)\..+)", name):
            state[f"model.layers.{m_[1]}.{m_[2]}"] = w
    for k, kind in enumerate(kinds):
        if kind == "E":
            for proj in ("up_proj", "down_proj"):
                experts = [state.pop(f"model.layers.{k}.mixer.experts.{e}.{proj}.weight") for e in range(8)]
                state[f"model.layers.{k}.mixer.experts.{proj}"] = torch.stack(experts)
    missing, unexpected = m.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) == {"model.embeddings.weight", "model.norm_f.weight", "lm_head.weight"}
    return list(m.model.layers)


def test_the_mtp_step_runs_as_vllm_composes_transformers_blocks(tiny):
    hf, ck_dir = tiny
    t = load_file(os.path.join(hf, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 10), generator=g)
    h_last = torch.randn(2, 10, 64, generator=g)  # the last decoder layer's output, before the final norm

    # reference: the next token's embedding (none after the last position: zero), the decoder's
    # final norm then hnorm on its output, the embedding first
    emb = torch.cat([t["backbone.embeddings.weight"][ids[:, 1:]], torch.zeros(2, 1, 64)], 1)
    first = MTP + "0."
    hidden = rms(rms(h_last, t["backbone.norm_f.weight"]), t[first + "hnorm.weight"])
    x = torch.cat([rms(emb, t[first + "enorm.weight"]), hidden], -1) @ t[first + "eh_proj.weight"].T
    pos = torch.arange(10)[None].expand(2, -1)
    want = [x]
    with torch.no_grad():
        for block in transformers_blocks(hf, t):
            out = block(want[-1], attention_mask=None, position_ids=pos)
            want.append(out[0] if isinstance(out, tuple) else out)
    final = rms(want[-1], t[MTP + "1.final_layernorm.weight"])

    with Checkpoint(ck_dir) as ck:
        mtp = load_mtp(ResolvedCheckpoint.of(ck, torch.float32), 0, device="cpu")
    ctx = LayerContext()
    with torch.no_grad():
        got = [mtp.mtp_input(ids, h_last)]
        for k in range(len(mtp.blocks)):
            got.append(mtp.run_block(k, got[-1], ctx))
        got_final = mtp.mtp_output(got[-1])
        whole = mtp(got[0], ctx)
    torch.testing.assert_close(got[0], x, rtol=1e-5, atol=1e-5)
    for k in (1, 2):  # each layer of the step: attention, then the latent MoE
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-5, msg=f"mtp.layers.{k - 1}")
    torch.testing.assert_close(whole, got[-1], rtol=0, atol=0)
    torch.testing.assert_close(got_final, final, rtol=1e-4, atol=1e-5)
    # it reads every tensor the release stores for the step (the routed experts stacked) and the
    # decoder's embedding and final norm, and nothing else
    names = {MTP[: -len("layers.")] + n for n in mtp.state_dict()}
    names |= {"backbone." + n for n in mtp.decoder_parts.state_dict()}
    stacked = {n for n in names if n.endswith((".w1", ".w2"))}
    assert stacked == {MTP + "1.mixer.experts.w1", MTP + "1.mixer.experts.w2"}
    release = {n for n in t if n.startswith(MTP) and ".experts." not in n}
    assert names - stacked == release | {"backbone.embed_tokens.weight", "backbone.norm.weight"}


def mtp_targets() -> list[str]:
    """The step's quantizable Linears (its eh_proj stays in the source dtype), its routed experts as one module."""
    attention = [f"{MTP}0.mixer.{p}_proj" for p in "qkvo"]
    moe = ["experts", "shared_experts.up_proj", "shared_experts.down_proj", "fc1_latent_proj", "fc2_latent_proj"]
    return attention + [f"{MTP}1.mixer.{n}" for n in moe]


def test_the_engine_calibrates_the_mtp_step_on_the_decoders_output(tiny):
    """After the last decoder layer the engine runs the step on the decoder's output and the next
    tokens, recording its input amax, the experts' amax and tokens and the attention's KV amax as
    one forward of the whole batch through the step does."""
    assert_the_engine_calibrates_mtp_as_one_forward(
        tiny[1], mtp_targets(), "mtp.", f"{MTP}1.mixer.experts", kv_attention=f"{MTP}0.mixer"
    )


@pytest.mark.parametrize("family, under", [("nemotron_h", ""), ("nemotron_h_omni", "language_model.")])
def test_an_mtp_recipe_exports_the_step_quantized(family, under, tmp_path):
    """`nvfp4_experts_fp8_attention_mtp`: the step's attention in FP8 and its routed experts in NVFP4,
    as the decoder's, every other tensor of it (eh_proj, the norms, the router, the shared expert,
    the latent projections) as the source holds it; the whole export predicted; eprt-check passes.
    The Omni's step is its language model's, under `language_model.`."""
    hf = make_tiny(family, str(tmp_path / "hf"))
    ck_dir = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    q = str(tmp_path / "q")
    args = PTQArgs(ck_dir, RECIPE, q, calib_size=2, seq_len=16, eval_size=0, progress=False)
    run_ptq(ParallelState.single(), args)
    out = export_hf(q, q + "-hf", progress=False)
    source, got = read_hf_tensors(hf), read_hf_tensors(out)
    fp8 = re.compile(r"(language_model\.)?(backbone|mtp)\.layers\.\d+\.mixer\.[qkvo]_proj")
    nvfp4 = re.compile(r"(language_model\.)?(backbone|mtp)\.layers\.\d+\.mixer\.experts\.\d+\.(up|down)_proj")
    want = set()
    for name in source:
        module = name.removesuffix(".weight")
        if fp8.fullmatch(module):
            want |= {f"{module}.{leaf}" for leaf in ("weight", "weight_scale", "input_scale")}
        elif nvfp4.fullmatch(module):
            want |= {f"{module}.{leaf}" for leaf in ("weight", "weight_scale", "weight_scale_2", "input_scale")}
        else:
            want.add(name)
    assert set(got) == want
    mtp = under + MTP
    assert got[f"{mtp}0.mixer.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert got[f"{mtp}1.mixer.experts.0.up_proj.weight"].dtype == torch.uint8
    for name in (f"{mtp}0.eh_proj.weight", f"{mtp}1.mixer.gate.weight", f"{mtp}1.mixer.fc1_latent_proj.weight"):
        assert torch.equal(got[name], source[name]), name
    layers = json.load(open(os.path.join(out, "hf_quant_config.json")))["quantization"]["quantized_layers"]
    assert {m for m in layers if m.startswith(mtp)} == {f"{mtp}0.mixer.{p}_proj" for p in "qkvo"} | {
        f"{mtp}1.mixer.experts"
    }
    assert check_export(str(out), hf) == []


@pytest.mark.parametrize(
    "change, named",
    [
        (dict(num_nextn_predict_layers=2), "num_nextn_predict_layers is 2"),
        (dict(mtp_hybrid_override_pattern="E*"), "a MoE only last"),
        (dict(mtp_hybrid_override_pattern="*M"), "attention and MoE layers"),
    ],
)
def test_an_mtp_step_eprt_does_not_run_is_refused_by_name(change, named):
    with pytest.raises(ConfigError, match=named):
        parse_hf_config({**tiny_config("nemotron_h"), **change})


def _calibrate(ck: str, out: str, port: int) -> None:
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, PTQArgs(ck, RECIPE, out, **CALIB))


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    d = tmp_path_factory.mktemp("nemotron_mtp_bf16")
    hf = make_tiny("nemotron_h", str(d / "hf"))
    return d, hf, convert_hf(hf, str(d / "ck"), progress=False)


@pytest.mark.timeout(300)
def test_the_mtp_export_is_the_same_bytes_at_world_2_ep_2(bf16):
    """Each rank runs the step on its own sequences with its own experts, the FP8 KV cache's scales
    of its attention too: the export is the single process's, byte for byte, in both layouts."""
    d, hf, ck = bf16
    run_ptq(ParallelState.single(), PTQArgs(ck, RECIPE, str(d / "q1"), **CALIB))
    run_world(_calibrate, 2, ck, str(d / "q2"), free_port(), timeout=240)
    for fmt in ("modelopt", "compressed-tensors"):
        single = export_hf(str(d / "q1"), str(d / f"q1-{fmt}"), progress=False, fmt=fmt)
        assert same_files(single, export_hf(str(d / "q2"), str(d / f"q2-{fmt}"), progress=False, fmt=fmt))
        assert check_export(single, hf) == []
    assert {f"{MTP}0.mixer.k_proj.k_scale", f"{MTP}0.mixer.v_proj.v_scale"} <= set(
        read_hf_tensors(str(d / "q1-modelopt"))
    )


def test_the_memory_plan_prices_the_mtp_step_a_recipe_runs(bf16):
    """Loaded whole, with the decoder's embedding and final norm it reads, the step is the tiny
    model's largest layer: the plan of a recipe that runs it holds its bytes (its routed experts
    shared by ep)."""
    _, hf, ck = bf16
    source = read_hf_tensors(hf)
    fp32 = ("mixer.gate.weight", "e_score_correction_bias")  # the router computes in fp32
    size = {n: t.numel() * (4 if n.endswith(fp32) else 2) for n, t in source.items() if n.startswith(MTP)}
    size |= {n: source[n].numel() * 2 for n in ("backbone.embeddings.weight", "backbone.norm_f.weight")}
    experts = sum(v for n, v in size.items() if ".experts." in n)
    with Checkpoint(ck) as c:
        plain = Planner.of(ResolvedCheckpoint.of(c, torch.bfloat16), torch.device("cpu"))
        planned = Planner.of(ResolvedCheckpoint.of(c, torch.bfloat16), torch.device("cpu"), mtp=True)
    for ep in (1, 2):
        assert planned._layer(ep)[0] == sum(size.values()) - experts + experts // ep
        assert plain._layer(ep)[0] < planned._layer(ep)[0]
