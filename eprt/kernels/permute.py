"""Token permutation into expert order and the weighted combine back."""

import torch


def permute(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, num_experts: int):
    """Gather the top-k copies of each token into expert order.

    Returns (x_sorted [T*K, D], tokens_per_expert [num_experts] int64, order [T*K]) where
    order[j] is the flat (t*K + k) index of sorted row j. The sort is stable, so within an
    expert rows keep token order.
    """
    flat = expert_ids_TK.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tokens_per_expert = torch.bincount(flat, minlength=num_experts)
    K = expert_ids_TK.shape[1]
    return x_TD[order // K], tokens_per_expert, order


def combine(y_sorted: torch.Tensor, order: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Inverse of `permute`: sum_k weights[t, k] * y[t, k] in fp32, k in order. Returns fp32 [T, D]."""
    T, K = weights_TK.shape
    y_flat = torch.empty_like(y_sorted, dtype=torch.float32)
    y_flat[order] = y_sorted.float()
    y_TKD = y_flat.view(T, K, -1)
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32, device=y_sorted.device)
    for k in range(K):
        out += weights_TK[:, k, None].float() * y_TKD[:, k]
    return out
