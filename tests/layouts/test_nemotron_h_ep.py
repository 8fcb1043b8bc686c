"""Nemotron-H under expert parallelism: every rank's logits are bitwise the single-process logits of
its batch, over more tokens than a Mamba chunk; FP8 and NVFP4 exports are the same bytes at every
(world, ep), pass eprt-check against the source, keep what vLLM builds unquantized as the source held
it (the router, Mamba's conv1d, A_log, D, dt_bias and gated norm, the carried MTP layers), and quantize
Mamba's in_proj/out_proj, attention, the relu² MLPs, the latent projections and every routed expert."""

import json
import os

import pytest

from tests.ep_checks import assert_ep_logits, assert_family_exports, tiny_checkpoints

FAMILY = "nemotron_h"
L = "backbone.layers"
# layers of the tiny model: 0 Mamba-2, 1 MoE, 2 attention, 3 MLP, 4 MoE
KEPT = [
    f"{L}.1.mixer.gate.weight",
    f"{L}.1.mixer.gate.e_score_correction_bias",
    f"{L}.0.mixer.conv1d.weight",
    f"{L}.0.mixer.conv1d.bias",
    f"{L}.0.mixer.A_log",
    f"{L}.0.mixer.D",
    f"{L}.0.mixer.dt_bias",
    f"{L}.0.mixer.norm.weight",
    "backbone.embeddings.weight",
    "mtp.layers.0.eh_proj.weight",
    "mtp.layers.1.mixer.experts.3.up_proj.weight",
]
QUANTIZED = [
    f"{L}.0.mixer.in_proj",
    f"{L}.0.mixer.out_proj",
    f"{L}.1.mixer.fc1_latent_proj",
    f"{L}.1.mixer.fc2_latent_proj",
    f"{L}.1.mixer.shared_experts.up_proj",
    f"{L}.2.mixer.q_proj",
    f"{L}.3.mixer.down_proj",
    f"{L}.4.mixer.experts.7.up_proj",
    f"{L}.4.mixer.experts.0.down_proj",
]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    return tiny_checkpoints(tmp_path_factory.mktemp(FAMILY), FAMILY)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,ep", [(2, 2), (4, 2)])
def test_expert_parallel_logits_are_bitwise_the_single_process_logits(ckpts, world, ep):
    assert_ep_logits([ckpts["fp32"][1]], world, ep, seq_len=20)  # Mamba chunks of 8: two and a partial one


@pytest.mark.timeout(400)
def test_exports_are_the_same_bytes_at_every_layout(ckpts, tmp_path):
    exports = assert_family_exports(
        {FAMILY: ckpts}, str(tmp_path), {FAMILY: []}, {FAMILY: QUANTIZED}, KEPT.__contains__
    )
    for _, _, source, exported, ref in exports:
        assert set(KEPT) <= set(source)
        for name in KEPT:
            assert f"{name.rpartition('.')[0]}.weight_scale" not in exported, name
        excluded = json.load(open(os.path.join(ref, "hf_quant_config.json")))["quantization"]["exclude_modules"]
        assert {f"{L}.1.mixer.gate", "backbone.embeddings", "mtp.layers.0.*"} <= set(excluded), excluded
