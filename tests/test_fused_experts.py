"""Routed experts held fused, one tensor per projection (`experts.gate_up_proj` [E, 2I, H],
`experts.down_proj` [E, H, I]): the form of Qwen3.5-MoE's releases and of transformers 5's MoE
parameters. In each family whose per-expert names are transformers', make_tiny's fused form is
transformers' own parameters, and it converts and exports back byte for byte. (Qwen3.5-MoE's
logits from the fused form: tests/oracles/test_qwen_next_models.py.)"""

import re

import pytest
import torch

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.hf_utils import raw, read_hf_tensors  # noqa: E402

FAMILIES = ["qwen3_moe", "deepseek_v3", "glm4_moe", "qwen3_next", "llama4_text"]


def layer(name: str) -> int:
    m = re.search(r"layers\.(\d+)\.", name)
    return int(m.group(1)) if m else -1


@pytest.mark.parametrize("family", FAMILIES)
def test_fused_experts_are_transformers_parameters_and_round_trip(tmp_path, family):
    hf = make_tiny(family, str(tmp_path / "hf"), fused_experts=True)
    config = AutoConfig.from_pretrained(hf)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    want = {n: tuple(t.shape) for n, t in model.state_dict().items() if ".experts." in n}
    source = read_hf_tensors(hf)
    # DeepSeek-V3's MTP layers (past num_hidden_layers) are carried, not modeled by transformers
    got = {n: tuple(t.shape) for n, t in source.items() if ".experts." in n and layer(n) < config.num_hidden_layers}
    assert got == want and want

    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    exported = read_hf_tensors(export_hf(ck, str(tmp_path / "export"), progress=False))
    assert set(exported) == set(source)
    for n in source:
        assert exported[n].dtype == source[n].dtype and raw(exported[n]) == raw(source[n]), n
