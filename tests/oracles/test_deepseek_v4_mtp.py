"""DeepSeek-V4's multi-token-prediction layer (the release's `mtp.0.`), built from the tensors
convert carries through. transformers 5.25 builds no MTP layer for V4 (it ignores `mtp.*` on load),
so the oracle is transformers' own pieces composed as DeepSeek's inference code (`MTPBlock`) and
vLLM's deepseek_v4_mtp.py compose them: its decoder layer, loaded as one more layer of the model,
on `h_proj(hnorm(streams)) + e_proj(enorm(embedding of the next token))` in every stream, and the
logits through transformers' hyper-head and norm loaded with the MTP layer's own `hc_head_*` and
`norm`, then the model's head. The engine then calibrates the layer on the last decoder layer's
streams as one forward of the whole batch does, and the memory plan prices it with the embedding it shares."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")
from transformers.masking_utils import create_sliding_window_causal_mask  # noqa: E402
from transformers.models.deepseek_v4.modeling_deepseek_v4 import (  # noqa: E402
    DeepseekV4HyperHead,
    DeepseekV4RMSNorm,
)

from eprt.families import reader_for  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.loading.loader import load_mtp  # noqa: E402
from eprt.loading.resolved import ResolvedCheckpoint  # noqa: E402
from eprt.models.decoder import LayerContext  # noqa: E402
from eprt.quant.run.planner import Planner  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.mtp_checks import (
    assert_an_expert_range_loads_only_its_experts,
    assert_the_engine_calibrates_mtp_as_one_forward,
)  # noqa: E402

LAYERS = 4  # the tiny DeepSeek-V4's decoder layers; its MTP layer is layer 4 of DeepSeek's reference
MTP = "mtp.0."
T = 20  # more than the sliding window (8) and several CSA entries (every 4 tokens)
# the MTP layer's own tensors, not its decoder layer's
FRONT_AND_HEAD = ("enorm.", "hnorm.", "e_proj.", "h_proj.", "norm.", "hc_head_")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """(release-spelled source, eprt checkpoint): fp32, index heads enough that no two index scores tie."""
    d = tmp_path_factory.mktemp("v4-mtp")
    hf = make_tiny("deepseek_v4", str(d / "hf"), dtype="fp32", index_n_heads=16)
    return hf, convert_hf(hf, str(d / "ck"), progress=False)


def transformers_with_the_mtp_block(hf: str, out: str):
    """transformers' DeepSeek-V4 read with one more decoder layer holding the MTP layer's block
    (its tensors under `layers.4.`, its kind the MTP layer's, routed by score), through
    transformers' own conversion of the release's names."""
    os.makedirs(out)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    kinds = cfg["compress_ratios"]
    cfg.update(num_hidden_layers=LAYERS + 1, num_nextn_predict_layers=0, compress_ratios=kinds + kinds[-1:])
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    t = load_file(os.path.join(hf, "model.safetensors"))
    block = {
        f"layers.{LAYERS}.{n[len(MTP) :]}": v.clone()
        for n, v in t.items()
        if n.startswith(MTP) and not n[len(MTP) :].startswith(FRONT_AND_HEAD)
    }
    save_file({**t, **block}, os.path.join(out, "model.safetensors"))
    return transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def assert_close_relative(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= 1e-4, err


def test_the_mtp_layer_runs_as_deepseeks_reference_composes_it(tiny, tmp_path):
    hf, ck_dir = tiny
    t = load_file(os.path.join(hf, "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, T), generator=g)
    h_last = torch.randn(2, T, 2, 64, generator=g)  # the last decoder layer's streams, before the head's collapse

    # reference: the next token's embedding (none after the last position: zero), each normed and projected
    emb = torch.cat([t["embed.weight"][ids[:, 1:]], torch.zeros(2, 1, 64)], 1)
    e = rms(emb, t[MTP + "enorm.weight"]) @ t[MTP + "e_proj.weight"].T
    x = rms(h_last, t[MTP + "hnorm.weight"]) @ t[MTP + "h_proj.weight"].T + e.unsqueeze(2)
    m = transformers_with_the_mtp_block(hf, str(tmp_path / "tf"))
    pos = torch.arange(T)[None].expand(2, -1)
    flat = x[:, :, 0]
    rotary = {kind: m.model.rotary_emb(flat, position_ids=pos, layer_type=kind) for kind in ("main", "compress")}
    mask = create_sliding_window_causal_mask(
        config=m.config, inputs_embeds=flat, attention_mask=None, cache=None, position_ids=pos
    )
    head = DeepseekV4HyperHead(m.config)
    norm = DeepseekV4RMSNorm(64, m.config.rms_norm_eps)
    head.load_state_dict({f"hc_{p}": t[f"{MTP}hc_head_{p}"] for p in ("fn", "base", "scale")})
    norm.load_state_dict({"weight": t[MTP + "norm.weight"]})
    with torch.no_grad():
        want = m.model.layers[LAYERS](x, position_embeddings=rotary, position_ids=pos, attention_mask=mask)
        want_logits = m.lm_head(norm(head(want)))

    with Checkpoint(ck_dir) as ck:
        mtp = load_mtp(ResolvedCheckpoint.of(ck, torch.float32), 0, device="cpu")
    with torch.no_grad():
        x_got = mtp.mtp_input(ids, h_last)
        got = mtp(x_got, LayerContext())
        logits = mtp.final(got) @ t["head.weight"].T
    torch.testing.assert_close(x_got, x, rtol=1e-5, atol=1e-5)
    assert_close_relative(got, want)
    assert_close_relative(logits, want_logits)
    # every tensor the source holds of the MTP layer has its place, and the model's embedding
    names = {MTP + n for n in mtp.state_dict()}
    stacked = {n for n in names if n.endswith((".w13", ".w2"))}
    assert {n for n in t if n.startswith(MTP) and ".experts." not in n} == names - stacked
    torch.testing.assert_close(mtp.decoder_parts.embed_tokens.weight, t["embed.weight"], rtol=0, atol=0)


def test_the_mtp_layer_is_of_the_kind_its_compress_ratio_says(tmp_path):
    """The release gives its MTP layers one more compress ratio each (0 in every release: a sliding
    window, no compressor); a list that stops at the decoder layers gives it the last layer's kind."""
    family = reader_for("deepseek_v4", "test")
    for ratios, compressed in (([0, 4, 128, 4, 0], False), ([0, 4, 128, 4], True)):
        hf = make_tiny("deepseek_v4", str(tmp_path / f"hf{len(ratios)}"), compress_ratios=ratios)
        source = {n for n in load_file(os.path.join(hf, "model.safetensors")) if n.startswith(MTP)}
        with Checkpoint(convert_hf(hf, str(tmp_path / f"ck{len(ratios)}"), progress=False)) as ck:
            mtp = load_mtp(ResolvedCheckpoint.of(ck, torch.float32), 0, device="cpu")
            specs = family.layout(ck.config).mtp
        assert hasattr(mtp.attn, "indexer") == compressed and hasattr(mtp.attn, "compressor") == compressed
        assert {n for s in specs for n in s.sources} == source
        assert any(".compressor." in n for n in source) == compressed


def mtp_targets() -> list[str]:
    """The MTP layer's quantizable Linears the engines run as Linears, its routed experts as one module."""
    attn = ["attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_b", "attn.indexer.wq_b"]
    ffn = ["ffn.experts", "ffn.shared_experts.w1", "ffn.shared_experts.w2", "ffn.shared_experts.w3"]
    return [MTP + n for n in ["e_proj", "h_proj", *attn, *ffn]]


def test_the_engine_calibrates_the_mtp_layer_on_the_last_layers_streams(tiny):
    """After the last decoder layer the engine runs the MTP layer on the last layer's streams and
    the next tokens, recording its input amax, expert amax and tokens as one forward of the whole
    batch through the MTP layer does."""
    whole = assert_the_engine_calibrates_mtp_as_one_forward(tiny[1], mtp_targets(), MTP, MTP + "ffn.experts")
    assert whole.expert_tokens[MTP + "ffn.experts"].sum() == 5 * 12 * 2  # every token to its top 2


def test_an_expert_range_loads_only_its_experts_of_the_mtp_layer(tiny):
    assert_an_expert_range_loads_only_its_experts(tiny[1], "ffn.experts")


def test_the_memory_plan_prices_the_mtp_layer_with_the_embedding_it_shares(tiny):
    """Loaded whole with the model's embedding it reads, the MTP layer is the tiny model's largest:
    the plan of a recipe that runs it holds its bytes and the embedding's (its routed experts shared by ep)."""
    hf, ck_dir = tiny
    size = {n: t.numel() * 4 for n, t in load_file(os.path.join(hf, "model.safetensors")).items()}
    experts = sum(v for n, v in size.items() if n.startswith(MTP + "ffn.experts."))
    whole = sum(v for n, v in size.items() if n.startswith(MTP)) + size["embed.weight"]
    with Checkpoint(ck_dir) as ck:
        plain = Planner.of(ResolvedCheckpoint.of(ck, torch.float32), torch.device("cpu"))
        planned = Planner.of(ResolvedCheckpoint.of(ck, torch.float32), torch.device("cpu"), mtp=True)
    for ep in (1, 2):
        assert planned._layer(ep)[0] == whole - experts + experts // ep
        assert plain._layer(ep)[0] < planned._layer(ep)[0]
