"""Writing a calibrated checkpoint: the calibration state, the recipe, and a reference to the base.

The weights are not copied: the manifest names the input checkpoint, the SHA-256 of its
manifest and a pin of each of its weight files (eprt.storage.checkpoint.weight_pin), checked whenever
the calibrated checkpoint is opened. Rank 0 writes the dense and KV
amax and the manifest; the first replica of each expert shard (edp rank 0) writes its own
experts' rows of the stacked per-expert state, so nothing is gathered.
"""

from __future__ import annotations

import os

import torch

from eprt.quant.calibrate import Calibrator
from eprt.quant.recipe import Recipe
from eprt.storage.checkpoint import Checkpoint, Part, TensorMeta, base_reference, manifest, write_manifest
from eprt.storage.safetensors_io import save_tensors

DENSE_FILE = "calibration.safetensors"


def experts_file(ep_rank: int) -> str:
    return f"calibration-experts-{ep_rank:05d}.safetensors"


def expert_state(cal: Calibrator) -> dict[str, torch.Tensor]:
    """This rank's rows of every per-expert state tensor, by name."""
    out = {}
    for module, (w13_in, w2_in) in cal.expert_amax.items():
        out[f"{module}.w13_input_amax"] = w13_in
        out[f"{module}.w2_input_amax"] = w2_in
        out[f"{module}.tokens"] = cal.expert_tokens[module]
    return out


def dense_state(cal: Calibrator) -> dict[str, torch.Tensor]:
    out = {f"{m}.input_amax": t for m, t in cal.input_amax.items()}
    for attn, (k, v) in cal.kv_amax.items():
        out[f"{attn}.k_amax"], out[f"{attn}.v_amax"] = k, v
    return out


def write_calibrated(tmp: str, out: str, state, cal: Calibrator, ck: Checkpoint, recipe: Recipe,
                     summary: dict) -> None:
    """Every rank calls this with the same shared temp directory `tmp` (published later as `out`)."""
    experts = expert_state(cal)
    if experts and state.edp_rank == 0:
        save_tensors(os.path.join(tmp, experts_file(state.ep_rank)), experts)
    if state.rank != 0:
        return
    dense = dense_state(cal)
    save_tensors(os.path.join(tmp, DENSE_FILE), dense)
    metas = [TensorMeta(n, t.dtype, tuple(t.shape), "raw", "calibration", (Part(DENSE_FILE, n, (0, 0)),), t.dtype)
             for n, t in dense.items()]
    E, ep = ck.config.num_experts, state.ep_size
    for n, t in experts.items():
        count = E // ep
        parts = tuple(Part(experts_file(r), n, (r * count, (r + 1) * count)) for r in range(ep))
        metas.append(TensorMeta(n, t.dtype, (E,), "raw", "calibration", parts, t.dtype))
    write_manifest(tmp, manifest(
        ck.family, ck.config, ck.source_config, metas, ck.hf_files,
        base=base_reference(out, ck.path),
        quantization={"recipe": recipe.to_json(), "calibration": summary}))
