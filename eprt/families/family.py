"""A family's entry: all eprt knows of one family (`ModelConfig.family`), in one object.

A family is one folder, `eprt/families/<name>/` (docs/adding-a-family.md): `config.py` reads its
config.json, `layout.py` names its checkpoint's tensors, `model.py` runs it, and `__init__.py`
holds its `FAMILY`, the entry this module describes, registered in one line of the family table
(eprt.families). The entry sits above the model code (it names the model class); this module and
the folders' `config.py` and `layout.py` sit below it, so that a config or a layout is read with
no torch-side code.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace

from eprt.config import ModelConfig
from eprt.layout import Layout

# Modules no recipe quantizes, in every family: the engines build them unquantized.
COMMON_UNQUANTIZED = (r"model\.embed_tokens", r"lm_head", r".*\.mlp\.gate")


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.family
    model_types: tuple[str, ...]  # the config.json `model_type`s it reads
    parse: Callable[[dict, str], ModelConfig]  # (config.json, its path for messages) -> ModelConfig
    tensors: Callable[[ModelConfig], Layout]  # the tensor layout: specs and what is only carried through
    # The model class that runs it: Class(config, expert_range=None), a CausalLM (eprt.models.decoder)
    # or a VLM wrapping one (eprt.models.vlm.LanguageModelOf).
    model: type
    # Regexes over tensor names the reference keeps in fp32 whatever the model dtype: the model
    # holds them in fp32, and a `--dtype` conversion leaves them in their source dtype.
    fp32: tuple[str, ...] = ()
    unquantized: tuple[str, ...] = COMMON_UNQUANTIZED  # regexes over module names no recipe quantizes
    # The class of its multi-token-prediction layers, where it runs them (Layout.mtp), else None:
    # Class(config, expert_range=None), with `mtp_input(input_ids, hidden, shift)`.
    mtp_model: type | None = None
    # Where MTP layer k's tensors are: (config, k) -> their prefix; None: DeepSeek-V3's
    # `layers.{num_hidden_layers + k}.` under the decoder's prefix.
    mtp_prefix: Callable[[ModelConfig, int], str] | None = None
    # The model's own tensors its MTP layers read too (DeepSeek-V4's shares the embedding), each
    # placed in an MTP layer under its name past `model.`.
    mtp_shared: tuple[str, ...] = ()

    def layout(self, c: ModelConfig) -> Layout:
        return replace(self.tensors(c), precise=self.fp32, unquantized=self.unquantized)

    def keeps_fp32(self, name: str) -> bool:
        return any(re.fullmatch(p, name) for p in self.fp32)

    def mtp_layer(self, c: ModelConfig, k: int, decoder_prefix: str = "model.") -> str:
        """The prefix of MTP layer k's tensors: `mtp_prefix`'s, else DeepSeek-V3's
        `layers.{num_hidden_layers + k}.` under `decoder_prefix`."""
        if self.mtp_prefix is not None:
            return self.mtp_prefix(c, k)
        return f"{decoder_prefix}layers.{c.num_layers + k}."


def language_model_of(text: Family, under: Callable[[tuple[str, ...]], tuple[str, ...]], **fields) -> Family:
    """A vision-language family whose language model is `text`'s: its fp32 and unquantized sets
    moved by `under` (regexes over the text model's names -> the same names in the VLM)."""
    return Family(**fields, fp32=under(text.fp32), unquantized=under(text.unquantized))
