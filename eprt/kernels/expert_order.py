"""Where each copy of a token goes in expert order, shared by the torch and the Triton permute/combine."""

import torch


def sort_by_expert(expert_ids_TK: torch.Tensor, num_experts: int):
    """(order, tokens_per_expert) for `permute`: a stable sort of the flat expert ids."""
    flat = expert_ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens_per_expert = torch.bincount(flat, minlength=num_experts)
    return order, tokens_per_expert


def slots(order: torch.Tensor) -> torch.Tensor:
    """The inverse of `order`: slots[t*K + k] is the row of y_sorted holding copy (t, k)."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device, dtype=order.dtype)
    return inverse
