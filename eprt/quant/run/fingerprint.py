"""What a calibration's result depends on, so that it is computed from exactly one model, recipe and data.

The fingerprint of a run holds its base checkpoint (the SHA-256 of its manifest and a pin of each
weight file, eprt.storage.pins.weight_pin), the recipe's rules as parsed (not its path: an
edited file is another recipe), the digest, shape and dtype of the calibration and held-out tokens
(the same tokens as 8 sequences of 8 are other data than 4 of 16), and every option that changes
a byte of the result. It serves three checks, each refusing by name what differs:

- before the first layer, every rank's fingerprint must equal rank 0's (a node reading a stale copy
  of the checkpoint or of the data would calibrate its share on other inputs);
- a `--resume` continues only from a work directory saved under the same fingerprint;
- the base's files as each was read, and as they are when the output is written, must be the ones
  pinned at the start (a base converted again in place during the run would mix two models).
"""

from __future__ import annotations

import hashlib
import json
import os

import torch
import torch.distributed as dist

from eprt.errors import CheckpointError, ConfigError
from eprt.parallel import ParallelState
from eprt.quant.algorithms.registry import option_flags
from eprt.storage.checkpoint import MANIFEST, Checkpoint, manifest_digest
from eprt.storage.pins import pin_changes, weight_pins

# options that change a byte of the result, and how the user names each
OPTIONS = {
    "dtype": "--dtype",
    "world": "the world size",
    "ep": "--ep",
    "group_size": "the sequences per expert work unit (group_tokens)",
    **option_flags(),  # each algorithm's run options (eprt.quant.algorithms.registry)
    "all_experts": "--calibrate-all-experts",
    # the tokens' digest already holds what these change; named, a refusal says which flag moved
    "seed": "--seed",
    "calib_rows": "--calib-rows",
}


def tokens_digest(ids: torch.Tensor | None) -> dict | None:
    if ids is None:
        return None
    return {
        "sha256": hashlib.sha256(ids.numpy().tobytes()).hexdigest(),
        "shape": list(ids.shape),
        "dtype": str(ids.dtype).removeprefix("torch."),
    }


def run_fingerprint(
    ck: Checkpoint, recipe, samples: torch.Tensor, eval_ids: torch.Tensor | None, options: dict
) -> dict:
    """`options`: the values of OPTIONS' keys this run calibrates with."""
    return {
        "base": {"manifest_sha256": manifest_digest(ck.path), "weights": weight_pins(ck)},
        "recipe": recipe.to_json(),
        "data": {"calibration": tokens_digest(samples), "held_out": tokens_digest(eval_ids)},
        "options": {k: options[k] for k in OPTIONS},
    }


def differences(then: dict, now: dict, base: str, times: bool = True) -> list[str]:
    """What differs between two fingerprints, by name; `times=False` ignores the weight files'
    modification times (copies on two nodes may hold the same bytes at different times)."""
    out = []
    b0, b1 = then.get("base", {}), now.get("base", {})
    if b0.get("manifest_sha256") != b1.get("manifest_sha256"):
        out.append(f"the base's manifest {os.path.join(base, MANIFEST)}")
    w0, w1 = b0.get("weights", {}), b1.get("weights", {})
    for f in sorted(set(w0) | set(w1)):
        changed = pin_changes(w0[f], w1.get(f)) if f in w0 else ["the file itself"]
        changed = [k for k in changed if times or k != "mtime_ns"]
        if changed:
            out.append(f"the base's weight file {os.path.join(base, f)} ({', '.join(changed)})")
    if then.get("recipe") != now.get("recipe"):
        out.append(f"the recipe's rules ({(now.get('recipe') or {}).get('name')})")
    for kind, what in (("calibration", "the calibration data"), ("held_out", "the held-out data")):
        d0, d1 = then.get("data", {}).get(kind), now.get("data", {}).get(kind)
        if d0 != d1:
            shapes = (d0 or {}).get("shape"), (d1 or {}).get("shape")
            out.append(
                f"{what} (sequences x tokens {shapes[0]}, now {shapes[1]})"
                if shapes[0] != shapes[1]
                else f"{what}'s tokens"
            )
    o0, o1 = then.get("options", {}), now.get("options", {})
    out += [f"{flag} ({o0.get(k)}, now {o1.get(k)})" for k, flag in OPTIONS.items() if o0.get(k) != o1.get(k)]
    return out


def agree_over_ranks(state: ParallelState, fingerprint: dict, base: str) -> None:
    """Refuse, on every rank alike, a run whose ranks read different checkpoints, recipes or data.
    Every rank of `state` must call it (it gathers every rank's fingerprint)."""
    if state.world == 1:
        return
    everyone = [None] * state.world
    dist.all_gather_object(everyone, fingerprint, group=state.dp_group)
    for rank, theirs in enumerate(everyone):
        differ = differences(everyone[0], theirs, base, times=False)
        if differ:
            raise ConfigError(
                f"rank {rank} reads other inputs than rank 0: {'; '.join(differ)} differ; every rank "
                "must read the same checkpoint, recipe and data (a node's stale copy?): copy them "
                "again so that every node holds the same files"
            )


def check_base_read(ck: Checkpoint, fingerprint: dict) -> None:
    """Refuse a base weight file that was not, as this run opened it, the one pinned at the start."""
    pinned = fingerprint["base"]["weights"]
    for f, pin in sorted(ck.read_pins.items()):
        changed = pin_changes(pinned[f], pin)
        if changed:
            raise CheckpointError(base_changed(ck.path, f, changed, "before this run read it"))


def check_base_unchanged(ck: Checkpoint, fingerprint: dict) -> None:
    """Refuse a base that, now, is not the one this run started from and read."""
    check_base_read(ck, fingerprint)
    if manifest_digest(ck.path) != fingerprint["base"]["manifest_sha256"]:
        raise CheckpointError(
            f"{os.path.join(ck.path, MANIFEST)} changed during calibration (converted again in "
            "place?), so the layers calibrated may come from two models: calibrate again once "
            "the checkpoint no longer changes"
        )
    check_pins_as_start(ck.path, fingerprint, weight_pins(ck), "during calibration")


def check_pins_as_start(path: str, fingerprint: dict, pins: dict, when: str) -> None:
    """Refuse `pins` of the base at `path` that are not those pinned at the start."""
    pinned = fingerprint["base"]["weights"]
    for f in sorted(set(pinned) | set(pins)):
        changed = pin_changes(pinned[f], pins.get(f)) if f in pinned else ["the file itself"]
        if changed:
            raise CheckpointError(base_changed(path, f, changed, when))


def base_changed(path: str, f: str, changed: list[str], when: str) -> str:
    return (
        f"{os.path.join(path, f)} changed {when} ({', '.join(changed)} differ from its pin at the start), so "
        "the layers calibrated may come from two models: calibrate again once the checkpoint no longer changes"
    )


def saved_fingerprint(text: str | None) -> dict:
    """A fingerprint as a work file stores it (json), or {} for one that is not."""
    try:
        found = json.loads(text) if text else {}
    except json.JSONDecodeError:
        return {}
    return found if isinstance(found, dict) else {}
