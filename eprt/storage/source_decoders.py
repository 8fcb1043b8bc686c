"""The registry of source encodings beyond those eprt.storage.encodings reads itself (block and
per-tensor FP8, compressed-tensors' formats): a family whose releases store weights in an encoding
of their own (packed blocks and scales under names of its own, announced by a `quant_method` of
its own) adds one here, and reading a source (convert's planner, the model-free export) consults
it by what config.json and the tensors' names say (docs/export.md, "Source decoders").

An entry (`SourceDecoder`) says
- `encoding`: its name, as a converted checkpoint's manifest and a planned weight record it;
- `methods`: the quantization_config `quant_method`s that announce it (a config naming another
  method eprt does not read is refused, as before);
- `find(tensors, config)`: the weights the checkpoint stores in it, from the tensors' names and
  headers (name -> TensorInfo): each as the name it decodes to -> its components (the decoder's
  local name -> the tensor's name); `suffix_finder` builds the common kind, components named by
  suffixes of the decoded name;
- `decoder(config)`: its decoder for quantization_config `config`: `.components` (the local names),
  `.decode(components) -> weight`, and `batched = True` where it decodes weights stacked along
  leading dims alike (one expert of a stacked weight is then decoded from its rows alone).

A module registers its entries when imported (`register`); a family's folder is imported with the
family table, before any source is read.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from eprt.errors import CheckpointError

Components = dict[str, str]  # the decoder's local name -> the tensor's name in the checkpoint


@dataclass(frozen=True)
class SourceDecoder:
    encoding: str
    methods: tuple[str, ...]
    find: Callable[[Mapping, dict], dict[str, Components]]
    decoder: Callable[[dict], object]


_REGISTRY: dict[str, SourceDecoder] = {}


def register(entry: SourceDecoder) -> SourceDecoder:
    """Adds `entry`; refuses an encoding name already taken by another entry."""
    have = _REGISTRY.get(entry.encoding)
    if have is not None and have != entry:
        raise ValueError(f"source encoding {entry.encoding!r} is registered twice")
    _REGISTRY[entry.encoding] = entry
    return entry


def registered(encoding: str) -> SourceDecoder | None:
    return _REGISTRY.get(encoding)


def announced_by(method) -> list[SourceDecoder]:
    """The entries a quantization_config of `quant_method` announces."""
    return [d for d in _REGISTRY.values() if method in d.methods]


def methods() -> list[str]:
    return sorted({m for d in _REGISTRY.values() for m in d.methods})


def find_encoded(tensors: Mapping, method, config: dict, where: str) -> dict[str, tuple[str, Components]]:
    """Every weight an entry that `method` announces finds among `tensors` (of checkpoint `where`):
    decoded name -> (encoding, components); refuses a tensor two weights claim."""
    out: dict[str, tuple[str, Components]] = {}
    owner: dict[str, str] = {}
    for entry in announced_by(method):
        try:
            found = entry.find(tensors, config)
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
            out[weight] = (entry.encoding, parts)
    return out


def suffix_finder(**suffixes: str) -> Callable[[Mapping, dict], dict[str, Components]]:
    """A `find` for components named by suffix of the weight they decode to: each tensor ending in
    the first suffix, with a tensor for every other suffix beside it, is one encoded weight.
    `suffix_finder(blocks="_blocks", scales="_scales")` finds `P_blocks` and `P_scales` as `P`."""
    marker = next(iter(suffixes.values()))

    def find(tensors: Mapping, config: dict) -> dict[str, Components]:
        out = {}
        for name in tensors:
            if not name.endswith(marker):
                continue
            weight = name[: -len(marker)]
            parts = {c: weight + s for c, s in suffixes.items()}
            missing = [n for n in parts.values() if n not in tensors]
            if missing:
                raise CheckpointError(f"tensor {name!r} is encoded, but its {missing[0]!r} is missing")
            out[weight] = parts
        return out

    return find
