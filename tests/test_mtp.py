"""DeepSeek-V3's multi-token-prediction layer, built from the tensors convert carries through:
its forward against transformers' decoder layer (the MTP block is a decoder layer of the
model's own kind) behind a plain-torch enorm/hnorm/eh_proj front, from the Hugging Face tensors."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from eprt.hf.convert import convert_hf
from eprt.models.deepseek_v3 import load_mtp
from eprt.models.rope import Rotary
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny

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
    hf, ck_dir = tiny
    t = load_file(os.path.join(hf, "model.safetensors"))
    p = f"model.layers.{LAYERS}."
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 512, (2, 10), generator=g)
    h_last = torch.randn(2, 10, 64, generator=g)  # the last decoder layer's output, before the final norm

    # reference: embedding of the next token (none after the last position: zero), enorm, hnorm, embedding first
    emb = t[p + "embed_tokens.weight"][ids[:, 1:]]
    emb = torch.cat([emb, torch.zeros(2, 1, 64)], 1)
    x = torch.cat([rms(emb, t[p + "enorm.weight"]), rms(h_last, t[p + "hnorm.weight"])], -1) @ t[p + "eh_proj.weight"].T
    m = transformers_layer(hf, str(tmp_path / "tf"))
    pos = torch.arange(10)[None].expand(2, -1)
    with torch.no_grad():
        out = m.model.layers[LAYERS](x, position_embeddings=m.model.rotary_emb(x, pos), attention_mask=None,
                                     position_ids=pos)
    want = out[0] if isinstance(out, tuple) else out

    ck = Checkpoint(ck_dir)
    try:
        mtp = load_mtp(ck, 0, dtype=torch.float32, device="cpu")
    finally:
        ck.close()
    c = ck.config
    cos, sin = Rotary(c.rotary_dim, c.rope_theta, c.rope_scaling, c.max_position_embeddings)(10, torch.float32, "cpu")
    with torch.no_grad():
        x_got = mtp.mtp_input(ids, h_last)
        got = mtp(x_got, cos, sin)
    torch.testing.assert_close(x_got, x, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    # every tensor the checkpoint carries for the MTP layer has its place, and nothing else
    names = {p + n for n in mtp.state_dict()}
    stacked = {n for n in names if n.endswith((".w13", ".w2"))}
    hf_names = {n for n in t if n.startswith(p)}
    assert {n for n in hf_names if ".experts." not in n} == names - stacked
