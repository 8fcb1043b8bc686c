"""The files of a Hugging Face checkpoint directory, by name, and the index of a sharded one.

Every reader and writer of a Hugging Face directory (convert's source, export, the checks, the
tiny fixtures, calibration data) names these files through this module.
"""

from __future__ import annotations

import json
import os

from eprt.storage.atomic import atomic_file

CONFIG = "config.json"
GENERATION_CONFIG = "generation_config.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"  # its special tokens, and the chat template calibration renders with
CHAT_TEMPLATE = "chat_template.jinja"  # the chat template as a file of its own (it then wins over tokenizer_config's)
QUANT_CONFIG = "hf_quant_config.json"  # ModelOpt's description of a quantized export
QUALITY = "eprt_quality.json"  # the PTQ quality report an export carries (eprt.quant.quality); no engine reads it
QUALITY_PAGE = "eprt_quality.html"  # the same report as a page (eprt.report), beside it
CARD = "README.md"  # a model card: the source's describes the source; a quantized export writes its own
SINGLE = "model.safetensors"  # the weights in one file
INDEX = "model.safetensors.index.json"  # the weights in shards: which shard holds each tensor


# What a quantized export carries of the source's non-weight files: what loading and serving it read
# (configs, tokenizer, chat template, processor configs, the model's own code) and its license; not
# the source's model card, sample data, evaluation files or images, which describe the source.
SERVED_FILES = (
    CONFIG,
    GENERATION_CONFIG,
    TOKENIZER,
    TOKENIZER_CONFIG,
    CHAT_TEMPLATE,
    "chat_template.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "tiktoken.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
)
SERVED_SUFFIXES = (".py", ".tiktoken")  # the model's own code (trust_remote_code), tiktoken vocabularies
LICENSES = ("LICENSE", "LICENCE", "NOTICE")


def served_file(rel: str) -> bool:
    """Whether a quantized export carries the source's non-weight file `rel` (SERVED_FILES)."""
    if os.path.dirname(rel):
        return False
    return rel in SERVED_FILES or rel.endswith(SERVED_SUFFIXES) or rel.upper().startswith(LICENSES)


def shard_name(i: int, count: int) -> str:
    """The file of shard `i` (0-based) of `count`: model-00001-of-00003.safetensors."""
    return f"model-{i + 1:05d}-of-{count:05d}.safetensors"


def write_index(directory: str, weight_map: dict[str, str], total_size: int) -> None:
    """`INDEX` in `directory`: every tensor's shard (sorted by tensor name), and the total tensor bytes."""
    write_json(
        os.path.join(directory, INDEX),
        {"metadata": {"total_size": total_size}, "weight_map": dict(sorted(weight_map.items()))},
    )


def write_json(path: str, data: dict) -> None:
    with atomic_file(path) as f:
        json.dump(data, f, indent=2)
