"""Llama-4 (`llama4_text`, and the language model of the `llama4` VLM): logits equal transformers'
Llama4ForCausalLM / Llama4ForConditionalGeneration (fp32) with every piece switched on and off
(chunked attention, NoPE layers and their temperature, the L2 q/k norm, Llama-3 RoPE scaling,
interleaved MoE and dense layers, biases, tied embeddings), at several dims; the VLM's vision tower
travels through export byte for byte; the router's score scales the expert's input, not its output."""

import pytest
import torch
from safetensors.torch import save

import eprt

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import (  # noqa: E402
    Llama4Config,
    Llama4ForCausalLM,
    Llama4ForConditionalGeneration,
    Llama4TextConfig,
)

from tests.hf_utils import read_hf_tensors  # noqa: E402
from tests.oracles.test_models import VOCAB, assert_logits_and_carried, record_routing  # noqa: E402

LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 16,
}
BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=16,
    intermediate_size_mlp=48,
    num_local_experts=8,
    num_experts_per_tok=1,
    max_position_embeddings=256,
    initializer_range=0.1,
)
CASES = {
    # Scout: every layer MoE, NoPE every 2nd, chunks of 4, L2 q/k norm, Llama-3 RoPE, temperature from position 2
    "scout_like": dict(
        num_hidden_layers=4,
        no_rope_layer_interval=2,
        attention_chunk_size=4,
        floor_scale=3,
        attn_scale=0.5,
        rope_parameters=LLAMA3,
    ),
    # Maverick: MoE and dense layers interleaved, no q/k norm, plain RoPE, NoPE every 3rd
    "maverick_like": dict(
        num_hidden_layers=4,
        interleave_moe_layer_step=2,
        no_rope_layer_interval=3,
        use_qk_norm=False,
        attention_chunk_size=5,
        floor_scale=2,
        attn_scale=0.3,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
        intermediate_size=24,
    ),
    # no chunking, no temperature, biases on every projection, tied embeddings, explicit layer lists
    # (the MoE layers listed beside the step that places them: the two must agree)
    "unchunked_biased_tied": dict(
        num_hidden_layers=3,
        attention_chunk_size=None,
        attn_temperature_tuning=False,
        attention_bias=True,
        tie_word_embeddings=True,
        moe_layers=[2],
        interleave_moe_layer_step=3,
        no_rope_layers=[1, 0, 1],
    ),
}
T = 12  # more tokens than a chunk, past the temperature's floor_scale


def text_config(case: str) -> Llama4TextConfig:
    return Llama4TextConfig(**{**BASE, **CASES[case]})


def spread_routers(model) -> None:
    """Router logits far enough apart that top-1 routing is no near-tie."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("feed_forward.router.weight"):
                p.normal_(0, 0.5)


@pytest.mark.parametrize("case", CASES)
def test_llama4_text_logits(tmp_path, case):
    cfg = text_config(case)
    torch.manual_seed(0)
    m = Llama4ForCausalLM(cfg).eval()
    spread_routers(m)
    m.save_pretrained(tmp_path / "hf")
    assert_logits_and_carried(tmp_path, m, "llama4_text", list(cfg.moe_layers), T, carried=("model.",))


def test_llama4_vlm_logits_and_vision_tower_carried(tmp_path):
    vision = dict(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        image_size=8,
        patch_size=4,
        vision_output_dim=32,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    cfg = Llama4Config(text_config=text_config("scout_like").to_dict(), vision_config=vision)
    torch.manual_seed(0)
    m = Llama4ForConditionalGeneration(cfg).eval()
    spread_routers(m)
    m.save_pretrained(tmp_path / "hf")
    carried = ("vision_model.", "multi_modal_projector.")
    assert_logits_and_carried(tmp_path, m, "llama4", list(cfg.text_config.moe_layers), T, carried)


def test_the_router_score_scales_the_experts_input(tmp_path):
    """Each MoE block sends its experts x * sigmoid(top logit) with weight 1: scaling their output
    instead (the usual MoE) changes the logits, so the oracle test above tells the two apart."""
    cfg = text_config("scout_like")
    torch.manual_seed(0)
    m = Llama4ForCausalLM(cfg).eval()
    spread_routers(m)
    m.save_pretrained(tmp_path / "hf")
    assert_logits_and_carried(tmp_path, m, "llama4_text", list(cfg.moe_layers), T, carried=("model.",))
    em = eprt.load_model(str(tmp_path / "ck"), dtype=torch.float32)
    ids = torch.randint(0, VOCAB, (2, T), generator=torch.Generator().manual_seed(1))
    for layer, (x_TD, ids_TK, w_TK) in record_routing(em, ids).items():
        block = em.model.layers[layer].feed_forward
        logits = torch.nn.functional.linear(x_TD, block.router.weight)
        score = torch.sigmoid(logits.max(-1).values)
        assert ids_TK.shape[1] == 1 and torch.equal(w_TK, torch.ones_like(w_TK))
        assert torch.equal(ids_TK[:, 0], logits.argmax(-1))
        assert x_TD.abs().sum() > 0 and score.min() < 0.9  # a score far from 1 would show a misplaced scale


def per_expert(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The fused, transposed experts of a saved model split into Linear-shaped tensors per expert, as
    Meta's FP8 Maverick names them (`feed_forward.experts.E.{gate,up,down}_proj.weight`)."""
    out = {}
    for name, t in tensors.items():
        prefix, _, leaf = name.rpartition(".")
        if leaf == "gate_up_proj":
            for e, gate_up_DI in enumerate(t):
                gate_DI, up_DI = gate_up_DI.chunk(2, dim=-1)
                out[f"{prefix}.{e}.gate_proj.weight"] = gate_DI.T.contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = up_DI.T.contiguous()
        elif leaf == "down_proj" and t.dim() == 3:
            out.update({f"{prefix}.{e}.down_proj.weight": down_ID.T.contiguous() for e, down_ID in enumerate(t)})
        else:
            out[name] = t
    return out


def test_experts_stored_per_expert_read_and_export_as_stored(tmp_path):
    """The same model with its experts stored per expert gives transformers' logits, and exports back
    exactly the per-expert tensors it was given."""
    cfg = text_config("maverick_like")
    torch.manual_seed(0)
    m = Llama4ForCausalLM(cfg).eval()
    spread_routers(m)
    m.save_pretrained(tmp_path / "hf")
    split = per_expert(read_hf_tensors(str(tmp_path / "hf")))
    assert any(".experts.7.up_proj.weight" in n for n in split) and not any("gate_up_proj" in n for n in split)
    (tmp_path / "hf" / "model.safetensors").write_bytes(save(split, metadata={"format": "pt"}))
    assert_logits_and_carried(tmp_path, m, "llama4_text", list(cfg.moe_layers), T, carried=("model.",))


def test_llama3_frequencies_are_transformers_at_scouts_settings():
    """Scout's own rope_scaling (low_freq_factor == high_freq_factor: the smoothing band is empty and the
    reference divides by zero there) and a band that is not, at the real head width: bit for bit."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from eprt.models.rope import llama3_frequencies, rope_frequencies

    for low, high in ((1.0, 1.0), (1.0, 4.0)):
        params = dict(LLAMA3, factor=16.0, low_freq_factor=low, high_freq_factor=high)
        params["original_max_position_embeddings"] = 8192
        cfg = Llama4TextConfig(**{**BASE, "head_dim": 128, "rope_parameters": params})
        want, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
        default, _ = rope_frequencies(128, 500000.0, None, cfg.max_position_embeddings)
        got = llama3_frequencies(default, 16.0, low, high, 8192)
        assert torch.equal(got, want), (low, high)
        assert not torch.equal(got, default)
