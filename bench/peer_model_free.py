"""The peer's side of bench/model_free.py: llm-compressor's `model_free_ptq` of a Hugging Face
checkpoint in FP8 block (its FP8_BLOCK preset: 128x128 weight blocks, inputs dynamic per group of
128), on CPU, leaving the same modules alone as eprt's model-free export does by default.

    PEER_PYTHON bench/peer_model_free.py --hf HF_DIR --out OUT [--workers N]

Run in an environment of its own that has llm-compressor (it pins its own transformers and
compressed-tensors); it imports nothing of eprt."""

import argparse

from llmcompressor import model_free_ptq

# eprt's default for this checkpoint: embeddings, lm_head and the routers (norms llm-compressor skips itself)
IGNORE = ["lm_head", "re:.*embed_tokens$", r"re:.*mlp\.gate$"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--hf", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--workers", type=int, default=1)
    a = p.parse_args()
    model_free_ptq(a.hf, a.out, scheme="FP8_BLOCK", ignore=IGNORE, max_workers=a.workers, device="cpu")


if __name__ == "__main__":
    main()
