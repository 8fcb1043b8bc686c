"""DeepSeek-V3's multi-token-prediction layer (and GLM-4.5's, the same around GQA attention), built
from the tensors convert carries through:
its forward against transformers' decoder layer (the MTP block is a decoder layer of the
model's own kind) behind a plain-torch enorm/hnorm/eh_proj front, from the Hugging Face tensors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import AutoModelForCausalLM  # noqa: E402

from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.loading.loader import (
    load_mtp,  # noqa: E402
)
from eprt.loading.resolved import ResolvedCheckpoint  # noqa: E402
from eprt.models.decoder import LayerContext  # noqa: E402
from eprt.models.rope import Rotary  # noqa: E402
from eprt.storage.checkpoint import Checkpoint  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.mtp_checks import (
    assert_an_expert_range_loads_only_its_experts,
    assert_the_engine_calibrates_mtp_as_one_forward,
)  # noqa: E402

LAYERS = 3  # the tiny DeepSeek-V3's decoder layers: its MTP layer is model.layers.3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("mtp")
    hf = make_tiny("deepseek_v3", str(d / "hf"), dtype="fp32")
    return hf, convert_hf(hf, str(d / "ck"), progress=False)


def transformers_layer(hf: str, out) -> torch.nn.Module:
    """transformers' DeepSeek-V3 read with one more decoder layer: the MTP layer's block, loaded by
    transformers' own weight conversion (its fused experts), and the model's rotary tables."""
    os.makedirs(out)
    cfg = json.load(open(os.path.join(hf, "config.json")))
    cfg.update(num_hidden_layers=LAYERS + 1, num_nextn_predict_layers=0)
    json.dump(cfg, open(os.path.join(out, "config.json"), "w"))
    for f in os.listdir(hf):
        if f.endswith((".safetensors", ".index.json")):
            os.symlink(os.path.join(hf, f), os.path.join(out, f))
    return AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="sdpa").eval()


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def test_the_mtp_layer_runs_as_the_engines_do(tiny, tmp_path):
    assert_runs_as_the_engines_do(*tiny, tmp_path, eps=1e-6)


def test_glm45s_mtp_layer_runs_as_the_engines_do(tmp_path):
    """GLM-4.5's MTP layer: DeepSeek-V3's front and shared head around its GQA decoder layer
    (partial rotary, q/k norms, q/k/v biases), as vLLM's glm4_moe_mtp builds it."""
    hf = make_tiny("glm4_moe", str(tmp_path / "hf"), dtype="fp32")
    assert_runs_as_the_engines_do(hf, convert_hf(hf, str(tmp_path / "ck"), progress=False), tmp_path, eps=1e-5)


def assert_runs_as_the_engines_do(hf: str, ck_dir: str, tmp_path, eps: float) -> None:
    t = load_file(os.path.join(hf, "model.safetensors"))
    p = f"model.layers.{LAYERS}."
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 10), generator=g)
    h_last = torch.randn(2, 10, 64, generator=g)  # the last decoder layer's output, before the final norm

    # reference: embedding of the next token (none after the last position: zero), enorm, hnorm, embedding first
    emb = t[p + "embed_tokens.weight"][ids[:, 1:]]
    emb = torch.cat([emb, torch.zeros(2, 1, 64)], 1)
    x = (
        torch.cat([rms(emb, t[p + "enorm.weight"], eps), rms(h_last, t[p + "hnorm.weight"], eps)], -1)
        @ t[p + "eh_proj.weight"].T
    )
    m = transformers_layer(hf, str(tmp_path / "tf"))
    pos = torch.arange(10)[None].expand(2, -1)
    with torch.no_grad():
        out = m.model.layers[LAYERS](
            x, position_embeddings=m.model.rotary_emb(x, pos), attention_mask=None, position_ids=pos
        )
    want = out[0] if isinstance(out, tuple) else out

    ck = Checkpoint(ck_dir)
    try:
        mtp = load_mtp(ResolvedCheckpoint.of(ck, torch.float32), 0, device="cpu")
    finally:
        ck.close()
    c = ck.config
    cos, sin = Rotary(c.rotary_dim, c.rope.theta, c.rope.yarn, c.max_position_embeddings)(10, torch.float32, "cpu")
    with torch.no_grad():
        x_got = mtp.mtp_input(ids, h_last)
        got = mtp(x_got, LayerContext(cos, sin))
    torch.testing.assert_close(x_got, x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # every tensor the checkpoint carries for the MTP layer has its place, and nothing else
    names = {p + n for n in mtp.state_dict()}
    stacked = {n for n in names if n.endswith((".w13", ".w2"))}
    hf_names = {n for n in t if n.startswith(p)}
    assert {n for n in hf_names if ".experts." not in n} == names - stacked


def mtp_targets(layers: int) -> list[str]:
    """The MTP layer's quantizable Linears the engine runs (its shared head is the model's head's
    kind and stays unquantized), its routed experts as one module."""
    p = f"model.layers.{layers}."
    attn = [
        "self_attn.q_a_proj",
        "self_attn.q_b_proj",
        "self_attn.kv_a_proj_with_mqa",
        "self_attn.kv_b_proj",
        "self_attn.o_proj",
    ]
    mlp = ["mlp.experts", "mlp.shared_experts.gate_proj", "mlp.shared_experts.up_proj", "mlp.shared_experts.down_proj"]
    return [p + n for n in ["eh_proj", *attn, *mlp]]


def test_the_engine_calibrates_the_mtp_layer_on_the_last_layers_hidden_states(tiny):
    """After the last decoder layer the engine runs the MTP layer on the final hidden states (before
    the final norm) and the next tokens, recording its input amax, expert amax and tokens and KV amax
    as one forward of the whole batch through the MTP layer does."""
    p = f"model.layers.{LAYERS}."
    assert_the_engine_calibrates_mtp_as_one_forward(
        tiny[1], mtp_targets(LAYERS), p, p + "mlp.experts", kv_attention=p + "self_attn"
    )


def test_an_expert_range_loads_only_its_experts_of_the_mtp_layer(tiny):
    assert_an_expert_range_loads_only_its_experts(tiny[1], "mlp.experts")
