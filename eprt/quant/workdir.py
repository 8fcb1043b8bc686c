"""The work directory of a layer-major calibration: what a killed run resumes from.

After each decoder layer, every rank saves, atomically, its sequences' hidden states (and block
snapshots) at that layer boundary with its statistics so far, as `rank-RRRRR/layer-NNNNN.safetensors`.
A rank drops its previous layer's file only once every rank has saved the new one, so the
ranks always share a last completed layer. A run started again with the same arguments and
`--resume` continues after it, and computes the same bits as a run never stopped.
"""

from __future__ import annotations

import json
import os
import re
import shutil

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from eprt.storage.atomic import fsync_dir
from eprt.errors import ConfigError
from eprt.progress import logger
from eprt.quant.calibrate import Calibrator
from eprt.quant.engine import LayerState
from eprt.storage.safetensors_io import save_tensors

LAYER_FILE = re.compile(r"layer-(\d{5})\.safetensors")


class WorkDir:
    def __init__(self, path: str, state, fingerprint: dict):
        self.path, self.state = path, state
        self.fingerprint = json.dumps(fingerprint, sort_keys=True)
        self.mine = os.path.join(path, f"rank-{state.rank:05d}")

    def _layers(self) -> list[int]:
        if not os.path.isdir(self.mine):
            return []
        return sorted(int(m.group(1)) for f in os.listdir(self.mine) if (m := LAYER_FILE.fullmatch(f)))

    def _file(self, layer: int) -> str:
        return os.path.join(self.mine, f"layer-{layer:05d}.safetensors")

    def last_completed(self, resume: bool) -> int:
        """The last layer every rank has saved (-1: none), agreed over the world; without
        `resume`, -1 and this rank's files of an earlier run dropped."""
        if not resume:
            shutil.rmtree(self.mine, ignore_errors=True)
            return -1
        layers = self._layers()
        last = torch.tensor(layers[-1] if layers else -1, device=self.state.device)
        self.state.all_reduce(last, over="dp", op=dist.ReduceOp.MIN)
        return int(last)

    def save(self, layer: int, ls: LayerState, cal: Calibrator, held=None, gptq=None) -> None:
        """With `held` (the quality report's held-out streams, eprt.quant.engine.Held), its two
        streams and what the report measured so far are saved too; with `gptq`
        (eprt.quant.gptq_layer.GPTQResults), GPTQ's codes so far."""
        os.makedirs(self.mine, exist_ok=True)
        tensors, metadata = {**states("", ls), **stats(cal)}, {"fingerprint": self.fingerprint}
        if held is not None:
            tensors.update({**states("eval.ref.", held.ref), **states("eval.quant.", held.quant)})
            metadata["quality"] = held.report.saved()
        if gptq is not None:
            tensors.update(gptq.tensors())
        tmp = self._file(layer) + ".partial"
        save_tensors(tmp, {k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata)
        os.replace(tmp, self._file(layer))
        fsync_dir(self.mine)
        # every rank now holds `layer`: the older files are no longer the common last layer
        self.state.all_reduce(torch.zeros((), device=self.state.device), over="dp")
        for old in self._layers():
            if old < layer:
                os.remove(self._file(old))

    def load(self, layer: int, cal: Calibrator, device, held=None, gptq=None) -> LayerState:
        path = self._file(layer)
        from safetensors import safe_open

        with safe_open(path, "pt") as f:
            metadata = f.metadata() or {}
        found = metadata.get("fingerprint")
        if found != self.fingerprint:
            raise ConfigError(f"{path}: saved by a run with other arguments ({found}); run without --resume, "
                              f"or remove {self.path}")
        tensors = load_file(path, device=str(device))
        load_stats(cal, tensors)
        if held is not None:
            held.ref, held.quant = from_states("eval.ref.", tensors), from_states("eval.quant.", tensors)
            held.report.restore(metadata["quality"])
        if gptq is not None:
            gptq.load(tensors)
        if self.state.rank == 0:
            logger().info("resuming after layer %d from %s", layer, self.path)
        return from_states("", tensors)

    def remove(self) -> None:
        """Once the output is written: every rank drops its own files, rank 0 the directory."""
        shutil.rmtree(self.mine, ignore_errors=True)
        self.state.all_reduce(torch.zeros((), device=self.state.device), over="dp")
        if self.state.rank == 0:
            shutil.rmtree(self.path, ignore_errors=True)


def states(prefix: str, ls: LayerState) -> dict[str, torch.Tensor]:
    return {f"{prefix}hidden": ls.hidden, **{f"{prefix}block.{j}": b for j, b in enumerate(ls.blocks)}}


def from_states(prefix: str, tensors: dict[str, torch.Tensor]) -> LayerState:
    count = sum(k.startswith(f"{prefix}block.") for k in tensors)
    return LayerState(tensors[f"{prefix}hidden"], [tensors[f"{prefix}block.{j}"] for j in range(count)])


def stats(cal: Calibrator) -> dict[str, torch.Tensor]:
    out = {f"input_amax/{n}": t for n, t in cal.input_amax.items()}
    for n, (w13, w2) in cal.expert_amax.items():
        out[f"w13_amax/{n}"], out[f"w2_amax/{n}"], out[f"tokens/{n}"] = w13, w2, cal.expert_tokens[n]
    out.update({f"all_tokens/{n}": t for n, t in cal.expert_all_tokens.items()})
    for n, (k, v) in cal.kv_amax.items():
        out[f"k_amax/{n}"], out[f"v_amax/{n}"] = k, v
    return out


def load_stats(cal: Calibrator, tensors: dict[str, torch.Tensor]) -> None:
    """Refill the statistics `stats` saved (observers installed later keep adding to them)."""
    got = {kind: {} for kind in ("input_amax", "w13_amax", "w2_amax", "tokens", "all_tokens", "k_amax", "v_amax")}
    for key, t in tensors.items():
        kind, _, name = key.partition("/")
        if kind in got:
            got[kind][name] = t  # on the device `load` read them to, where the observers add to them
    cal.input_amax.update(got["input_amax"])
    cal.expert_amax.update({n: (t, got["w2_amax"][n]) for n, t in got["w13_amax"].items()})
    cal.expert_tokens.update(got["tokens"])
    cal.expert_all_tokens.update(got["all_tokens"])
    cal.kv_amax.update({n: (t, got["v_amax"][n]) for n, t in got["k_amax"].items()})
