"""How often a calibration saves a layer boundary to its work directory, and what one save costs.

A save (eprt.quant.run.workdir.WorkDir.save) writes a rank's hidden states, with the quality report's
streams and block snapshots, copied to the host, then syncs the file before it takes its name:
at real size the largest write of a run (DeepSeek-V3 at 512 x 4096 tokens: 30 GB a layer over the
ranks). `--save-every N` saves after every N-th layer (1, the default: after each), 0 never: a
killed run then starts over, and `--resume` is refused.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import torch

from eprt.storage.atomic import fsync_path
from eprt.storage.safetensors_io import save_tensors


def saves_after(layer: int, every: int) -> bool:
    """Whether the run saves the boundary after decoder layer `layer` (0-based)."""
    return every > 0 and (layer + 1) % every == 0


def saves(num_layers: int, every: int) -> int:
    """The saves a run of `num_layers` decoder layers makes."""
    return sum(saves_after(i, every) for i in range(num_layers))


def existing_dir(path: str) -> str:
    """`path`, or its nearest ancestor that exists: the file system a directory made there lies on."""
    path = os.path.abspath(path)
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def save_seconds(work_dir: str, sample: torch.Tensor, save_bytes: int) -> float:
    """One save of `save_bytes` in `work_dir`'s file system, timed by writing `sample` (copied to the
    host, written and synced as a save writes it) in a directory made for it and removed, scaled from
    `sample`'s bytes to `save_bytes`."""
    scratch = tempfile.mkdtemp(prefix=".eprt-save-time-", dir=existing_dir(work_dir))
    try:
        path = os.path.join(scratch, "layer.safetensors")
        start = time.perf_counter()
        save_tensors(path, {"hidden": sample.detach().cpu().contiguous()}, {})
        fsync_path(path)
        took = time.perf_counter() - start
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return took * save_bytes / max(sample.nbytes, 1)
