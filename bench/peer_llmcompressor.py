"""The peer's side of bench/peer_quality.py: llm-compressor's one-shot quantization of a Hugging
Face checkpoint, in the scheme of an eprt export, on the token sequences eprt calibrates on.

    PEER_PYTHON bench/peer_llmcompressor.py --hf HF_DIR --tokens CALIB.pt --scheme SCHEME.json \
        --algorithm gptq --out OUT

Run by bench/peer_quality.py in an environment of its own that has llm-compressor (it pins its own
transformers and compressed-tensors); it imports nothing of eprt. SCHEME.json is the eprt export's
`quantization_config` (its config groups and ignore list), so both sides quantize the same
modules in the same format. Algorithms: `rtn` (llm-compressor's QuantizationModifier), `gptq`,
`awq` (its AWQ transform, then round to nearest), `awq+gptq` (its AWQ transform, then GPTQ), each
with llm-compressor's defaults."""

import argparse
import json

import torch
from datasets import Dataset
from llmcompressor import oneshot
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.quantization import QuantizationModifier
from llmcompressor.modifiers.transform.awq import AWQModifier
from llmcompressor.pipelines.cache import IntermediatesCache
from transformers import AutoModelForCausalLM

ALGORITHMS = ("rtn", "gptq", "awq", "awq+gptq")


def recipe(algorithm: str, scheme: dict) -> list:
    groups = {
        name: {k: v for k, v in group.items() if k != "format"} for name, group in scheme["config_groups"].items()
    }
    quantize = {"config_groups": groups, "ignore": scheme.get("ignore", [])}
    rounding = GPTQModifier(**quantize) if algorithm.endswith("gptq") else QuantizationModifier(**quantize)
    return ([AWQModifier()] if algorithm.startswith("awq") else []) + [rounding]


def main() -> None:
    if not torch.cuda.is_available():  # AWQ pins its cached activations, which needs an accelerator
        IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf", required=True)
    p.add_argument("--tokens", required=True, help="the calibration sequences, a [n, T] int64 tensor (torch.save)")
    p.add_argument("--scheme", required=True, help="the eprt export's quantization_config (JSON)")
    p.add_argument("--algorithm", required=True, choices=ALGORITHMS)
    p.add_argument("--out", required=True)
    a = p.parse_args()
    tokens = torch.load(a.tokens)
    with open(a.scheme) as f:
        scheme = json.load(f)
    model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.bfloat16)
    data = Dataset.from_dict({"input_ids": tokens.tolist(), "attention_mask": torch.ones_like(tokens).tolist()})
    oneshot(
        model=model,
        dataset=data,
        recipe=recipe(a.algorithm, scheme),
        max_seq_length=tokens.shape[1],
        num_calibration_samples=tokens.shape[0],
        shuffle_calibration_samples=False,
    )
    model.save_pretrained(a.out, save_compressed=True)


if __name__ == "__main__":
    main()
