"""The registry of source encodings: how a Hugging Face checkpoint stores a weight encoded (packed
codes and scales under names of their own, announced by config.json's `quant_method`), found by
what config.json and the tensors' names say, and decoded. Reading a source (convert's planner, the
model-free export) and reading an eprt checkpoint consult it alone (docs/sources.md, "Source
decoders"). The encodings eprt reads itself are its entries too (registered by
eprt.storage.encodings, which every reader imports; found by eprt.storage.source_finders: block and
per-tensor FP8, MXFP8, DeepSeek-V4's FP8 and FP4, GPT-OSS's MXFP4 blocks, each compressed-tensors
format); a family whose releases store weights in an encoding of its own adds one.

An entry (`SourceDecoder`) says
- `encoding`: its name, as a converted checkpoint's manifest and a planned weight record it;
- `methods`: the quantization_config `quant_method`s that announce it (a config naming a method no
  entry names is refused);
- `find(tensors, quant)`: the weights the checkpoint stores in it, from the tensors' names and
  headers (name -> TensorInfo): each as the name it decodes to -> its components (the decoder's
  local name -> the tensor's name). `quant` is the source's quantization (eprt.storage.encodings
  .SourceQuantization) where it announces the entry, else None: an encoding whose tensors are
  known by their names alone refuses them then (config.json does not account for them), any other
  finds nothing. A refusal about one tensor is a `SourceError` naming it, so that the file holding
  it is named. `suffix_finder` builds the common kind, components named by suffixes of the
  decoded name;
- `decoder(scheme, where)`: its decoder for the scheme a weight follows (the quantization_config,
  or the config group `scheme_of` names), `where` naming it in messages: `.components` (the local
  names), `.decode(components) -> weight`, and `batched = True` where it decodes weights stacked
  along leading dims alike (one expert of a stacked weight is then decoded from its rows alone);
- `scheme_of(weight, quant)`: the name of the scheme a found weight follows (compressed-tensors':
  its config group); None, the default: the quant_method, its whole quantization_config the scheme.

A module registers its entries when imported (`register`); a family's folder is imported with the
family table, before any source is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from eprt.errors import CheckpointError

Components = dict[str, str]  # the decoder's local name -> the tensor's name in the checkpoint


class SourceError(CheckpointError):
    """A finder's refusal of tensor `tensor`: the reader prefixes the file that holds it."""

    def __init__(self, tensor: str, message: str):
        super().__init__(message)
        self.tensor = tensor


@dataclass(frozen=True)
class SourceDecoder:
    encoding: str
    methods: tuple[str, ...]
    find: Callable[[Mapping, object], dict[str, Components]]
    decoder: Callable[[dict, str], object]
    scheme_of: Callable[[str, object], str] | None = None


_REGISTRY: dict[str, SourceDecoder] = {}


def register(entry: SourceDecoder) -> SourceDecoder:
    """Adds `entry`; refuses an encoding name already taken by another entry."""
    have = _REGISTRY.get(entry.encoding)
    if have is not None and have != entry:
        raise ValueError(f"source encoding {entry.encoding!r} is registered twice")
    _REGISTRY[entry.encoding] = entry
    return entry


def entries() -> list[SourceDecoder]:
    return list(_REGISTRY.values())


def registered(encoding: str) -> SourceDecoder | None:
    return _REGISTRY.get(encoding)


def announced_by(method) -> list[SourceDecoder]:
    """The entries a quantization_config of `quant_method` announces."""
    return [d for d in entries() if method in d.methods]


def methods() -> list[str]:
    return sorted({m for d in entries() for m in d.methods})


def find_encoded(
    tensors: Mapping, quant, where: str, files: Mapping[str, str]
) -> dict[str, tuple[str, str, Components]]:
    """Every weight an entry finds among `tensors` (of checkpoint `where`, each held by file
    `files[name]`) under the source's quantization `quant` (None: none declared): decoded name ->
    (encoding, scheme, components); refuses a tensor two weights claim, and a weight two entries find."""
    out: dict[str, tuple[str, str, Components]] = {}
    owner: dict[str, str] = {}
    for entry in entries():
        announced = quant is not None and quant.method in entry.methods
        try:
            found = entry.find(tensors, quant if announced else None)
        except SourceError as e:
            raise CheckpointError(f"{files.get(e.tensor, where)}: {e}") from None
        except CheckpointError as e:
            raise CheckpointError(f"{where}: {e}") from None
        for weight, parts in found.items():
            for name in parts.values():
                if name in owner:
                    raise CheckpointError(
                        f"{where}: tensor {name!r} is a component of both {owner[name]!r} and {weight!r}; "
                        "the checkpoint's names are ambiguous"
                    )
                owner[name] = weight
            if weight in out:
                raise CheckpointError(
                    f"{where}: {weight!r} is stored both as {out[weight][0]} and as {entry.encoding}; "
                    "the checkpoint's names are ambiguous"
                )
            scheme = entry.scheme_of(weight, quant) if entry.scheme_of is not None else quant.method
            out[weight] = (entry.encoding, scheme, parts)
    return out


def suffix_finder(**suffixes: str) -> Callable[[Mapping, object], dict[str, Components]]:
    """A `find` for components named by suffix of the weight they decode to: each tensor ending in
    the first suffix, with a tensor for every other suffix beside it, is one encoded weight, where
    the config announces the encoding. `suffix_finder(blocks="_blocks", scales="_scales")` finds
    `P_blocks` and `P_scales` as `P`."""
    marker = next(iter(suffixes.values()))

    def find(tensors: Mapping, quant) -> dict[str, Components]:
        out = {}
        if quant is None:  # names like these may be plain tensors of a checkpoint that announces no such encoding
            return out
        for name in tensors:
            if not name.endswith(marker):
                continue
            weight = name[: -len(marker)]
            parts = {c: weight + s for c, s in suffixes.items()}
            missing = [n for n in parts.values() if n not in tensors]
            if missing:
                raise SourceError(name, f"tensor {name!r} is encoded, but its {missing[0]!r} is missing")
            out[weight] = parts
        return out

    return find
