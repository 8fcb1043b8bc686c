"""A Hugging Face checkpoint directory as a source of tensors: sharded or single-file safetensors."""

from __future__ import annotations

import os

from eprt.errors import CheckpointError
from eprt.storage.bounded import read_json_object
from eprt.storage.hf_files import INDEX, SINGLE
from eprt.storage.paths import resolve_inside
from eprt.storage.safetensors_io import SafetensorsFile, TensorInfo

# Weights in other serializations are not read, and not carried either: they would be a
# second copy of the model in a format eprt never writes.
_OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".h5", ".msgpack", ".ckpt")


def is_weight_file(rel: str) -> bool:
    base = os.path.basename(rel)
    return (
        base.endswith(".safetensors")
        or base == INDEX
        or base.endswith(_OTHER_WEIGHTS)
        or base.endswith(".bin.index.json")
    )


def non_weight_files(root: str) -> list[str]:
    """Every file under `root` that is not a weight, relative, sorted (hidden entries skipped);
    a link that resolves outside `root` is refused (eprt.storage.paths), not copied with what it points to."""
    found = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not x.startswith("."))
        for f in sorted(files):
            rel = os.path.relpath(os.path.join(d, f), root)
            if not f.startswith(".") and not is_weight_file(rel):
                resolve_inside(root, rel, root)
                found.append(rel)
    return found


class HFSource:
    """Every tensor of a Hugging Face directory, with the shard that holds it; headers checked on open."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index_path = os.path.join(hf_dir, INDEX)
        if os.path.isfile(index_path):
            index = read_json_object(index_path, "download the checkpoint again", CheckpointError)
            try:
                weight_map = dict(index["weight_map"])
                shards = sorted(set(weight_map.values()))
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(f"{index_path}: corrupt index ({e!r})") from None
        elif os.path.isfile(os.path.join(hf_dir, SINGLE)):
            weight_map, shards = None, [SINGLE]
        else:
            raise CheckpointError(f"{hf_dir}: no {SINGLE} or {INDEX}; eprt reads safetensors checkpoints")
        self.files: dict[str, SafetensorsFile] = {}
        self.tensors: dict[str, tuple[SafetensorsFile, TensorInfo]] = {}
        for shard in shards:
            path = resolve_inside(hf_dir, shard, index_path if weight_map is not None else hf_dir)
            if not os.path.isfile(path):
                raise CheckpointError(f"{index_path}: lists shard {shard} which is missing from {hf_dir}")
            f = self.files[shard] = SafetensorsFile(path)
            for name, info in f.tensors.items():
                if name in self.tensors:
                    raise CheckpointError(f"{path}: tensor {name!r} is also in {self.tensors[name][0].path}")
                self.tensors[name] = (f, info)
        if weight_map is not None:
            for name, shard in weight_map.items():
                if name not in self.files[shard].tensors:
                    raise CheckpointError(
                        f"{os.path.join(hf_dir, shard)}: the index lists tensor {name!r} but the file lacks it"
                    )

    def shard_of(self, name: str) -> str:
        """The file (relative to the directory) that holds tensor `name`."""
        f = self.tensors[name][0]
        return next(shard for shard, g in self.files.items() if g is f)

    @property
    def bytes_read(self) -> int:
        return sum(f.bytes_read for f in self.files.values())

    def close(self) -> None:
        for f in self.files.values():
            f.close()
