"""Build a model from an eprt checkpoint: on the meta device first, then each tensor read from
disk straight into its place (one tensor in flight, never a second copy of the model)."""

from __future__ import annotations

import torch

from eprt.checkpoint import Checkpoint
from eprt.config import reader_for
from eprt.errors import CheckpointError, ConfigError
from eprt.models.decoder import CausalLM
from eprt.models.registry import model_class


def load_model(ckpt_dir: str, *, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
               expert_range: tuple[int, int] | None = None) -> CausalLM:
    """The model of an eprt checkpoint, in `dtype` (except the tensors the reference keeps in fp32),
    on `device`, ready for inference (no parameter requires grad).

    expert_range=(first, count) loads only routed experts [first, first + count) of every MoE layer,
    reading only their rows; a forward pass then needs an expert-parallel dispatcher
    (`model.set_dispatcher`)."""
    ck = Checkpoint(ckpt_dir)
    try:
        return _load(ck, dtype, device, expert_range)
    finally:
        ck.close()


def _load(ck: Checkpoint, dtype, device, expert_range) -> CausalLM:
    c = ck.config
    first, count = expert_range or (0, c.num_experts)
    if c.moe_layers and not (0 <= first and 0 < count and first + count <= c.num_experts):
        raise ConfigError(f"expert_range ({first}, {count}) is outside the {c.num_experts} experts of {ck.path}")
    with torch.device("meta"):
        model = model_class(c.family)(c, expert_range=(first, count))
    model.requires_grad_(False)

    stacked = {s.name for s in reader_for(c.model_type, ck.path).layout(c).specs if s.is_expert}
    wanted = model.state_dict()
    _check_tensors(ck, wanted, stacked)
    for name in wanted:
        t = ck.read(name, rows=(first, first + count) if name in stacked else None)
        t = t.to(device=device, dtype=torch.float32 if model.keeps_fp32(name) else dtype)
        module, _, attr = name.rpartition(".")
        model.get_submodule(module).load_state_dict({attr: t}, strict=False, assign=True)
    return model


def _check_tensors(ck: Checkpoint, wanted: dict[str, torch.Tensor], stacked: set[str]) -> None:
    """Refuse before reading anything if the checkpoint's tensors are not the model's."""
    have = set(ck.names())
    missing = [n for n in wanted if n not in have]
    extra = sorted(have - set(wanted))
    if missing or extra:
        raise CheckpointError(f"{ck.path}: the checkpoint's tensors do not match the {ck.config.family} model: "
                              f"missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                              f"unexpected {extra[:5]}{'...' if len(extra) > 5 else ''}")
    for name, slot in wanted.items():
        expected = tuple(slot.shape)
        if name in stacked:  # the model holds a range of the experts; the checkpoint holds them all
            expected = (ck.config.num_experts, *expected[1:])
        if tuple(ck.meta(name).shape) != expected:
            raise CheckpointError(f"{ck.path}: {name} has shape {list(ck.meta(name).shape)}, "
                                  f"the model expects {list(expected)}")
