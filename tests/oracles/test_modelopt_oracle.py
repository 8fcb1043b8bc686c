"""eprt's quantized export against ModelOpt's own, on the same tiny model and the same tokens.

ModelOpt quantizes the transformers model loaded from the same Hugging Face directory with its
FP8 / NVFP4 (MLA's kv_b_proj left out, as eprt's nvfp4 recipe leaves it) / NVFP4-experts-only configs, and the NVFP4-experts config with FP8 attention quantizers
added (mixed precision: MIXED_PRECISION with quantized_layers), plus its FP8 KV-cache config (its NVFP4 one in
tests/test_kv_nvfp4.py), calibrates it with `max` over the token ids
eprt calibrates on, and writes `export_hf_checkpoint`. Compared:
- tensor names, and every tensor byte for byte (quantized weights, weight scales, unquantized
  weights), except the activation-derived scales (input_scale, k_scale, v_scale), which come
  from two different forward implementations in bf16 and must agree within 1%;
- hf_quant_config.json and config.json's quantization_config, whole (exclude_modules included,
  with ModelOpt's prefix-wildcard summary), except the producer's `exported_by`, which eprt adds
  to say who wrote it.
Two deliberate differences are set aside: DeepSeek-V3's MTP layers, which transformers does not
load (so ModelOpt drops them) and eprt carries through unquantized, listed in exclude_modules;
and the DeepSeek-V3 router weight, which transformers holds (and ModelOpt writes) in fp32 and
eprt writes in the source's dtype: the values must be equal.
"""

import copy
import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("modelopt")

# an oracle of the tests, skipped by name where it is not installed
pytest.importorskip("transformers")
import modelopt.torch.quantization as mtq  # noqa: E402
from modelopt.torch.export import export_hf_checkpoint  # noqa: E402
from modelopt.torch.quantization.utils.core_utils import update_quant_cfg_with_kv_cache_quant  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from eprt.data import calibration_samples  # noqa: E402
from eprt.hf.convert import convert_hf  # noqa: E402
from eprt.hf.export import export_hf  # noqa: E402
from eprt.parallel import ParallelState  # noqa: E402
from eprt.quant.run.ptq import PTQArgs, run_ptq  # noqa: E402
from eprt.testing.tiny import make_tiny  # noqa: E402
from tests.hf_utils import read_hf_tensors  # noqa: E402

FAMILIES = ["qwen3_moe", "deepseek_v3"]


def experts_nvfp4_attention_fp8() -> dict:
    """ModelOpt's NVFP4-experts config with FP8 per-tensor quantizers on the attention: a mixed-precision export."""
    cfg = copy.deepcopy(mtq.NVFP4_EXPERTS_ONLY_CFG)
    fp8 = {"num_bits": (4, 3), "axis": None}
    last_experts_rule = max(i for i, r in enumerate(cfg["quant_cfg"]) if ".experts." in r["quantizer_name"])
    cfg["quant_cfg"][last_experts_rule + 1 : last_experts_rule + 1] = [
        {"quantizer_name": "*self_attn*weight_quantizer", "cfg": fp8},
        {"quantizer_name": "*self_attn*input_quantizer", "cfg": fp8},
    ]
    return cfg


def nvfp4_but_kv_b_proj() -> dict:
    """ModelOpt's NVFP4 config with MLA's kv_b_proj left unquantized, as eprt's nvfp4 recipe leaves it
    (vLLM's identity-matrix absorption would rescale it under NVFP4 inputs: eprt.hf.check_engine_quirks)."""
    cfg = copy.deepcopy(mtq.NVFP4_DEFAULT_CFG)
    cfg["quant_cfg"].append({"quantizer_name": "*kv_b_proj*", "enable": False})
    return cfg


MODELOPT_CFG = {
    "fp8": mtq.FP8_DEFAULT_CFG,
    "nvfp4": nvfp4_but_kv_b_proj(),
    "nvfp4_experts_only": mtq.NVFP4_EXPERTS_ONLY_CFG,
    "nvfp4_experts_fp8_attention": experts_nvfp4_attention_fp8(),
}
KV_CFG = {"fp8": mtq.FP8_KV_CFG, "nvfp4": mtq.NVFP4_KV_CFG}  # by eprt's --kv-cache name
SAMPLES, SEQ_LEN = 4, 32
ACTIVATION_SCALES = ("input_scale", "k_scale", "v_scale")


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    d = tmp_path_factory.mktemp("oracle")
    out = {}
    for family in FAMILIES:
        hf = make_tiny(family, str(d / family / "hf"))
        config = json.loads(Path(hf, "config.json").read_text())
        out[family] = (hf, convert_hf(hf, str(d / family / "ck"), progress=False), config)
    return out


def modelopt_export(hf: str, config: dict, recipe: str, kv: str | None, out: str) -> str:
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.bfloat16)
    cfg = MODELOPT_CFG[recipe]
    if kv:
        cfg = update_quant_cfg_with_kv_cache_quant(cfg, KV_CFG[kv]["quant_cfg"])
    tokens = calibration_samples(None, hf, num_samples=SAMPLES, seq_len=SEQ_LEN, vocab_size=config["vocab_size"])

    def forward_loop(m):
        with torch.no_grad():
            m(tokens)

    mtq.quantize(model, cfg, forward_loop)
    export_hf_checkpoint(model, export_dir=out)
    return out


def eprt_export(ck: str, recipe: str, kv: str | None, out: str) -> str:
    run_ptq(
        ParallelState.single(),
        PTQArgs(
            ck,
            recipe,
            out,
            kv_cache=kv,
            calib_size=SAMPLES,
            seq_len=SEQ_LEN,
            batch_size=SAMPLES,
            progress=False,
        ),
    )
    return export_hf(out, out + "-hf", progress=False)


def without_mtp(names, layers: int) -> set[str]:
    """Names outside DeepSeek-V3's MTP layers (index >= num_hidden_layers), which transformers drops."""
    return {n for n in names if not ((m := re.search(r"layers\.(\d+)\.", n)) and int(m.group(1)) >= layers)}


def quant_configs(out: str, layers: int) -> tuple[dict, dict]:
    hf_quant = json.loads(Path(out, "hf_quant_config.json").read_text())
    qc = json.loads(Path(out, "config.json").read_text())["quantization_config"]
    for producer in (hf_quant["producer"], qc["producer"]):
        producer.pop("exported_by", None)
    for excluded in (hf_quant["quantization"].get("exclude_modules", []), qc["ignore"]):
        excluded[:] = sorted(without_mtp(excluded, layers) - {f"model.layers.{i}.*" for i in range(layers, 99)})
    if hf_quant["quantization"].get("exclude_modules") == []:  # a mixed export excludes nothing but MTP
        hf_quant["quantization"].pop("exclude_modules")
    return hf_quant, qc


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "fmt, kv",
    [
        ("fp8", None),
        ("fp8", "fp8"),
        ("nvfp4", None),
        ("nvfp4", "fp8"),
        ("nvfp4_experts_only", "fp8"),
        ("nvfp4_experts_fp8_attention", "fp8"),
    ],
)
def test_the_export_is_modelopts(sources, tmp_path, family, fmt, kv):
    hf, ck, config = sources[family]
    compare_with_modelopt(hf, config, fmt, kv, eprt_export(ck, fmt, kv, str(tmp_path / "eprt")), tmp_path)


def compare_with_modelopt(hf: str, config: dict, fmt: str, kv: str | None, ours_out: str, tmp_path: Path) -> None:
    """eprt's export `ours_out` of recipe `fmt` (and KV format `kv`) against ModelOpt's of the same
    source `hf`, as the module docstring says."""
    layers = config["num_hidden_layers"]
    theirs = read_hf_tensors(modelopt_export(hf, config, fmt, kv, str(tmp_path / "modelopt")))
    ours = read_hf_tensors(ours_out)

    assert set(theirs) == without_mtp(ours, layers)
    assert any(n.endswith(".k_scale") for n in theirs) == (kv is not None)
    for name in sorted(theirs):
        a, b = theirs[name], ours[name]
        assert a.shape == b.shape, name
        if name.endswith(ACTIVATION_SCALES):
            assert a.dtype == b.dtype == torch.float32, name
            assert abs(b.item() / a.item() - 1) <= 0.01, (name, a.item(), b.item())
        elif a.dtype != b.dtype:  # the router, held in fp32 by transformers: same values
            assert name.endswith(".mlp.gate.weight") and a.dtype == torch.float32, (name, a.dtype, b.dtype)
            assert torch.equal(a, b.float()), name
        else:
            assert torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8)), name
    assert quant_configs(ours_out, layers) == quant_configs(str(tmp_path / "modelopt"), layers)
