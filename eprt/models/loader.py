"""Build a model from an eprt checkpoint: on the meta device first, then each tensor read from
disk straight into its place (one tensor in flight, never a second copy of the model).

In an expert-parallel run (`parallel=state`) every rank reads the dense tensors whole and only
the rows of its own routed experts, and every step that can fail on one rank alone fails together.
"""

from __future__ import annotations

import torch

from eprt.errors import CheckpointError, ConfigError
from eprt.families import reader_for
from eprt.models.decoder import CausalLM
from eprt.models.registry import model_class
from eprt.parallel import EPDispatcher, ExpertPlacement, ParallelState, fail_together
from eprt.storage.checkpoint import Checkpoint


def load_model(ckpt_dir: str, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device | None = None,
               expert_range: tuple[int, int] | None = None, parallel: ParallelState | None = None) -> CausalLM:
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
            return _load(ck, dtype, device or "cpu", expert_range)
        finally:
            ck.close()
    if expert_range is not None:
        raise ValueError("pass expert_range or parallel, not both: a parallel load holds state.expert_range")
    ck = open_checkpoint(ckpt_dir, parallel)
    try:
        with fail_together(parallel, "loading the checkpoint"):
            model = _load(ck, dtype, device or parallel.device, parallel.placement(ck.config.num_experts).range)
    finally:
        ck.close()
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


def weight_bytes(ck: Checkpoint, *, dtype: torch.dtype, expert_range: tuple[int, int] | None = None) -> tuple[int, int]:
    """(dense, routed experts): bytes of the weights `load_model` holds for `expert_range`, in
    `dtype` as it loads them, from the manifest alone (no weight is read)."""
    model, stacked = _meta_model(ck, expert_range)
    dense = experts = 0
    for name, t in model.state_dict().items():
        n = t.numel() * (torch.float32 if model.keeps_fp32(name) else dtype).itemsize
        if name in stacked:
            experts += n
        else:
            dense += n
    return dense, experts


def _meta_model(ck: Checkpoint, expert_range) -> tuple[CausalLM, set[str]]:
    """The model built on the meta device for `expert_range`, and the names of its stacked expert tensors."""
    c = ck.config
    first, count = expert_range or ExpertPlacement(c.num_experts).range
    if c.moe_layers and not (0 <= first and 0 < count and first + count <= c.num_experts):
        raise ConfigError(f"expert_range ({first}, {count}) is outside the {c.num_experts} experts of {ck.path}")
    with torch.device("meta"):
        model = model_class(c.family)(c, expert_range=(first, count))
    model.requires_grad_(False)
    stacked = {s.name for s in reader_for(c.model_type, ck.path).layout(c).specs if s.is_expert}
    return model, stacked


def _load(ck: Checkpoint, dtype, device, expert_range) -> CausalLM:
    model, stacked = _meta_model(ck, expert_range)
    wanted = model.state_dict()
    _check_tensors(ck, wanted, stacked)
    ck.check_decode(dtype)
    assign_tensors(ck, model, list(wanted), stacked, dtype=dtype, device=device, expert_range=expert_range)
    return model


def meta_model(ck: Checkpoint, expert_range: tuple[int, int] | None = None) -> tuple[CausalLM, set[str]]:
    """The model on the meta device, checked against the checkpoint's tensors (nothing is read),
    and the names of its stacked expert tensors: `assign_tensors` then fills any part of it."""
    model, stacked = _meta_model(ck, expert_range)
    _check_tensors(ck, model.state_dict(), stacked)
    return model, stacked


def assign_tensors(ck: Checkpoint, model, names: list[str], stacked: set[str], *, dtype: torch.dtype, device,
                   expert_range: tuple[int, int] | None) -> int:
    """Read tensors `names` of `model` (only the rows of `expert_range` of stacked experts) into
    their places, one tensor in flight; returns the bytes placed."""
    first, count = expert_range or ExpertPlacement(ck.config.num_experts).range
    placed = 0
    for name in names:
        module, _, attr = name.rpartition(".")
        slot = getattr(model.get_submodule(module), attr)
        if name in stacked:
            rows = (first, first + count)
        elif slot.shape and ck.meta(name).shape[0] > slot.shape[0]:
            rows = (0, slot.shape[0])  # a padded tensor (Kimi-K3's A_log): the model's entries lead
        else:
            rows = None
        t = ck.read(name, rows=rows)
        t = t.to(device=device, dtype=torch.float32 if model.keeps_fp32(name) else dtype)
        model.get_submodule(module).load_state_dict({attr: t}, strict=False, assign=True)
        placed += t.numel() * t.element_size()
    return placed


def _check_tensors(ck: Checkpoint, wanted: dict[str, torch.Tensor], stacked: set[str]) -> None:
    """Refuse before reading anything if the checkpoint's tensors are not the model's."""
    have = set(ck.names())
    missing = [n for n in wanted if n not in have]
    extra = sorted(have - set(wanted))
    if missing or extra:
        raise CheckpointError(f"{ck.path}: the checkpoint's tensors do not match the {ck.config.family} model: "
                              f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                              f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}")
    padded = {s.name for s in reader_for(ck.config.model_type, ck.path).layout(ck.config).specs if s.padded_per}
    for name, slot in wanted.items():
        expected = tuple(slot.shape)
        if name in stacked:  # the model holds a range of the experts; the checkpoint holds them all
            expected = (ck.config.num_experts, *expected[1:])
        stored = tuple(ck.meta(name).shape)
        if name in padded and len(stored) == len(expected) and stored[0] >= expected[0]:
            continue
        if stored != expected:
            raise CheckpointError(f"{ck.path}: {name} has shape {list(ck.meta(name).shape)}, "
                                  f"the model expects {list(expected)}")
