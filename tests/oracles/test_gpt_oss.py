"""GPT-OSS (`gpt_oss`): logits equal transformers' GptOssForCausalLM (fp32) with every piece on (sinks,
sliding-window and full layers, biases on q/k/v/o, the router and the experts, the clamped SwiGLU,
YaRN), at several dims; the fused, transposed, interleaved experts export as they were stored."""

import pytest
import torch

import eprt

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import GptOssConfig, GptOssForCausalLM  # noqa: E402

from tests.oracles.test_models import VOCAB, assert_logits_and_carried  # noqa: E402

BASE = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=24,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=256,
    sliding_window=4,
)
CASES = {
    # the release's shape: sliding then full, YaRN (factor 32, untruncated), biases everywhere
    "release_like": dict(num_hidden_layers=4),
    # other dims, full layers first (layer_types), a wider window, top 3, no attention biases, tied head
    "full_first_untied_dims": dict(
        num_hidden_layers=3,
        layer_types=["full_attention", "sliding_attention", "sliding_attention"],
        sliding_window=5,
        hidden_size=48,
        num_attention_heads=6,
        num_key_value_heads=3,
        head_dim=8,
        intermediate_size=16,
        num_experts_per_tok=3,
        attention_bias=False,
        tie_word_embeddings=True,
        swiglu_limit=0.5,  # the clamps bite on every token
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
    ),
}
T = 12  # more tokens than a window


def randomized(cfg: GptOssConfig, seed: int = 0) -> GptOssForCausalLM:
    """The model with every parameter random and away from its initial value: sinks of either sign
    and as large as the attention logits, biases that move the routing, router logits spread apart."""
    torch.manual_seed(seed)
    m = GptOssForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith("sinks"):
                p.normal_(0, 1.0)
            elif name.endswith("router.weight"):
                p.normal_(0, 0.5)
            elif name.endswith(("bias", "_bias")):
                p.normal_(0, 0.1)
            elif name.endswith("norm.weight"):
                p.normal_(1.0, 0.1)
            elif name.endswith(("gate_up_proj", "down_proj")):
                p.normal_(0, 0.3)
            else:
                p.normal_(0, 0.1)
    return m


@pytest.mark.parametrize("case", CASES)
def test_gpt_oss_logits(tmp_path, case):
    cfg = GptOssConfig(**{**BASE, **CASES[case]})
    m = randomized(cfg)
    m.save_pretrained(tmp_path / "hf")
    assert_logits_and_carried(tmp_path, m, "gpt_oss", list(range(cfg.num_hidden_layers)), T, carried=("model.",))
    em = eprt.load_model(str(tmp_path / "ck"), dtype=torch.float32)
    own = em.config.own
    assert own.sliding_layers == tuple(i for i, t in enumerate(cfg.layer_types) if t == "sliding_attention")
    assert own.sliding_window == cfg.sliding_window
