"""eprt checkpoint -> Hugging Face directory: sharded safetensors with an index, plus every non-weight file.

The writer takes a list of output tensors (`eprt.hf.tensors`), each produced on demand, so that the
unquantized and the quantized export share sharding, indexing and atomic output.
"""

from __future__ import annotations

import json
import os

from eprt.atomic import atomic_output_dir, copy_files
from eprt.checkpoint import Checkpoint
from eprt.errors import EprtError
from eprt.hf import compressed
from eprt.hf.check_export import check_export
from eprt.hf.export_quantized import QuantizedExport, write_quantized_configs
from eprt.hf.source import INDEX
from eprt.hf.tensors import OutTensor, source_tensors
from eprt.progress import bar, logger
from eprt.safetensors_io import SafetensorsWriter

DEFAULT_SHARD_BYTES = 5 * 1024**3


def shard(tensors: list[OutTensor], max_bytes: int) -> list[list[OutTensor]]:
    shards, cur, size = [], [], 0
    for t in tensors:
        if cur and size + t.nbytes > max_bytes:
            shards.append(cur)
            cur, size = [], 0
        cur.append(t)
        size += t.nbytes
    return shards + [cur] if cur else shards


def write_hf_dir(tmp: str, tensors: list[OutTensor], *, max_shard_bytes: int, progress: bool) -> dict:
    """Write the shards and the index into `tmp`; returns the weight map."""
    shards = shard(tensors, max_shard_bytes)
    weight_map = {}
    with bar(sum(t.nbytes for t in tensors), "export", unit="B", enabled=progress) as pb:
        for i, group in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            w = SafetensorsWriter(os.path.join(tmp, fname), [(t.name, t.dtype, t.shape) for t in group])
            for t in group:
                if t.stored is not None:
                    w.copy_range(t.name, *t.stored())
                else:
                    w.write(t.name, t.produce())
                weight_map[t.name] = fname
                pb.update(t.nbytes)
            w.close()
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors)}, "weight_map": dict(sorted(weight_map.items()))}
    write_json(os.path.join(tmp, INDEX), index)
    return weight_map


def write_json(path: str, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
        f.flush()
        os.fsync(f.fileno())


def export_hf(ckpt_dir: str, out_dir: str, *, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
              overwrite: bool = False, progress: bool = True, dequantize: bool = False) -> str:
    """Write an eprt checkpoint in the Hugging Face layout: the source layout back for an
    unquantized checkpoint, the ModelOpt quantized layout for a calibrated one (checked before
    it appears).

    Weights the source stored compressed or in block FP8 go back as they came, byte for byte;
    with `dequantize`, decoded (bf16), under a config.json without its quantization_config. A
    quantized export always starts from the decoded weights."""
    with Checkpoint(ckpt_dir) as ck, atomic_output_dir(out_dir, overwrite=overwrite, inputs=(ckpt_dir,)) as tmp:
        if ck.quantization is None:
            tensors = list(source_tensors(ck, dequantize=dequantize))
            write_hf_dir(tmp, tensors, max_shard_bytes=max_shard_bytes, progress=progress)
            config = compressed.without_quantization(ck.source_config) if dequantize else ck.source_config
            rewrite = config != ck.source_config  # else config.json is copied byte for byte
            copy_files(ck.hf_files_dir(), [f for f in ck.hf_files if not (rewrite and f == "config.json")], tmp)
            if rewrite:
                write_json(os.path.join(tmp, "config.json"), config)
        else:
            exp = QuantizedExport(ck)
            tensors = exp.tensors()
            write_hf_dir(tmp, tensors, max_shard_bytes=max_shard_bytes, progress=progress)
            copy_files(ck.hf_files_dir(), [f for f in ck.hf_files if f != "config.json"], tmp)
            write_quantized_configs(ck, exp, tmp)
            problems = check_export(tmp)
            if problems:
                raise EprtError(f"the export of {ckpt_dir} fails its checks, so it was not written:\n  "
                                + "\n  ".join(problems))
    logger().info("exported %s -> %s (%d tensors)", ckpt_dir, out_dir, len(tensors))
    return out_dir
