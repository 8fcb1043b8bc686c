"""Build a model from an eprt checkpoint: on the meta device first, then each tensor read from
disk straight into its place (one tensor in flight, never a second copy of the model).

In an expert-parallel run (`parallel=state`) every rank reads the dense tensors whole and only
the rows of its own routed experts, and every step that can fail on one rank alone fails together.
"""

from __future__ import annotations

import torch

from eprt.errors import CheckpointError
from eprt.loading.resolved import ResolvedCheckpoint, place_tensors
from eprt.models.decoder import CausalLM
from eprt.parallel import EPDispatcher, ParallelState, fail_together
from eprt.storage.checkpoint import Checkpoint


def load_model(
    ckpt_dir: str,
    *,
    dtype: torch.dtype = torch.bfloat16,
    device: str | torch.device | None = None,
    expert_range: tuple[int, int] | None = None,
    parallel: ParallelState | None = None,
) -> CausalLM:
    """The model of an eprt checkpoint, in `dtype` (except the tensors the reference keeps in fp32),
    on `device` (default: the CPU, or the rank's device in a parallel load), ready for inference
    (no parameter requires grad).

    expert_range=(first, count) loads only routed experts [first, first + count) of every MoE layer,
    reading only their rows; a forward pass then needs an expert-parallel dispatcher
    (`model.set_dispatcher`).

    parallel=state loads this rank's share of an expert-parallel run: experts
    `state.placement(E).range`, with an `EPDispatcher(state)` on every MoE block. Every rank of the
    state must call it. An ep that does not divide the experts is refused on every rank before
    any weight is read, and a failure on any rank raises `RankFailure`, naming that rank, on all.
    """
    if parallel is None:
        ck = Checkpoint(ckpt_dir)
        try:
            return _load(ResolvedCheckpoint.of(ck, dtype, expert_range), device or "cpu")
        finally:
            ck.close()
    if expert_range is not None:
        raise ValueError("pass expert_range or parallel, not both: a parallel load holds state.expert_range")
    ck = open_checkpoint(ckpt_dir, parallel)
    try:
        return load_parallel(ResolvedCheckpoint.of(ck, dtype), parallel, device)
    finally:
        ck.close()


def load_parallel(
    rc: ResolvedCheckpoint, parallel: ParallelState, device: str | torch.device | None = None
) -> CausalLM:
    """`load_model(..., parallel=parallel)` of a checkpoint already open and resolved (in its dtype):
    this rank's experts, on `device` (default: the rank's), with an `EPDispatcher(parallel)`."""
    with fail_together(parallel, "loading the checkpoint"):
        model = _load(rc.holding(parallel.placement(rc.ck.config.num_experts).range), device or parallel.device)
    model.set_dispatcher(lambda layer, block: EPDispatcher(parallel))
    return model


def open_checkpoint(ckpt_dir: str, parallel: ParallelState) -> Checkpoint:
    """The checkpoint's manifest, read on every rank of `parallel`, once its routed experts are
    known to split over the ep degree.

    Reading can fail on one rank alone (its own copy, its own mount), so it fails together. The
    expert check is the same arithmetic on every rank, so every rank refuses alike with one
    `ConfigError` naming the valid ep degrees, before any weight is read.
    """
    with fail_together(parallel, "reading the checkpoint manifest"):
        ck = Checkpoint(ckpt_dir)
    try:
        parallel.check_experts(ck.config.num_experts)
    except BaseException:
        ck.close()
        raise
    return ck


def weight_bytes(rc: ResolvedCheckpoint) -> tuple[int, int]:
    """(dense, routed experts): bytes of the weights `load_model` holds for `rc`'s experts, in its
    dtype as it loads them, from the manifest alone (no weight is read)."""
    model = build_meta(rc)
    dense = experts = 0
    for name, t in model.state_dict().items():
        n = t.numel() * rc.run_dtype(name).itemsize
        if name in rc.stacked:
            experts += n
        else:
            dense += n
    return dense, experts


def build_meta(rc: ResolvedCheckpoint) -> CausalLM:
    """The model of `rc` built on the meta device, holding its range of the routed experts."""
    with torch.device("meta"):
        model = rc.family.model(rc.ck.config, expert_range=rc.expert_range)
    model.requires_grad_(False)
    return model


def load_mtp(rc: ResolvedCheckpoint, k: int, *, device) -> torch.nn.Module:
    """MTP layer k of the checkpoint `rc` resolves (its family's `mtp_model`), built from the
    tensors convert carries through under their Hugging Face names (and the model's tensors it
    shares, `Family.mtp_shared`): the routed experts of its range stacked as the decoder layers
    hold theirs, in its run dtypes (the router's tensors in fp32, as everywhere)."""
    c = rc.ck.config
    with torch.device("meta"):
        mtp = rc.family.mtp_model(c, rc.expert_range)
    mtp.requires_grad_(False)
    prefix = rc.family.mtp_layer(c, k)
    place_tensors(rc, mtp, [s.name for s in rc.layout.mtp if s.name.startswith(prefix)], device=device, prefix=prefix)
    place_tensors(rc, mtp, list(rc.family.mtp_shared), device=device, prefix="model.")
    return mtp


def _load(rc: ResolvedCheckpoint, device: str | torch.device) -> CausalLM:
    model = build_meta(rc)
    wanted = model.state_dict()
    _check_tensors(rc, wanted)
    rc.ck.check_decode(rc.dtype)
    place_tensors(rc, model, list(wanted), device=device)
    return model


def checked_meta(rc: ResolvedCheckpoint) -> CausalLM:
    """The model of `rc` on the meta device, checked against the checkpoint's tensors (nothing is
    read): `place_tensors(rc, ...)` then fills any part of it."""
    model = build_meta(rc)
    _check_tensors(rc, model.state_dict())
    return model


def _check_tensors(rc: ResolvedCheckpoint, wanted: dict[str, torch.Tensor]) -> None:
    """Refuse before reading anything if the checkpoint's tensors are not the model's."""
    ck = rc.ck
    have = set(ck.names())
    missing = [n for n in wanted if n not in have]
    extra = sorted(have - set(wanted))
    if missing or extra:
        raise CheckpointError(
            f"{ck.path}: the checkpoint's tensors do not match the {ck.config.family} model: "
            f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}"
        )
    padded = {s.name for s in rc.layout.specs if s.padded_per}
    for name, slot in wanted.items():
        expected = tuple(slot.shape)
        if name in rc.stacked:  # the model holds a range of the experts; the checkpoint holds them all
            expected = (ck.config.num_experts, *expected[1:])
        stored = tuple(ck.meta(name).shape)
        if name in padded and len(stored) == len(expected) and stored[0] >= expected[0]:
            continue
        if stored != expected:
            raise CheckpointError(
                f"{ck.path}: {name} has shape {list(ck.meta(name).shape)}, the model expects {list(expected)}"
            )
