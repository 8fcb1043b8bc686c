"""Token permutation into expert order and the weighted combine back."""

import torch

from eprt.kernels.backend import check_values, use_triton
from eprt.kernels.cpu_workers import for_each
from eprt.kernels.expert_order import slots, sort_by_expert


def permute(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, num_experts: int):
    """Gather the top-k copies of each token into expert order.

    Returns (x_sorted [T*K, D], tokens_per_expert [num_experts] int64, order [T*K]) where
    order[j] is the flat (t*K + k) index of sorted row j. The sort is stable, so within an
    expert rows keep token order.
    """
    if x_TD.dim() != 2 or expert_ids_TK.dim() != 2 or expert_ids_TK.shape[0] != x_TD.shape[0]:
        raise ValueError(
            f"permute wants x [T, D] and expert_ids [T, K], got {tuple(x_TD.shape)} and {tuple(expert_ids_TK.shape)}"
        )
    if expert_ids_TK.dtype.is_floating_point or expert_ids_TK.dtype == torch.bool:
        raise ValueError(f"permute wants integer expert ids, got {expert_ids_TK.dtype}")
    if expert_ids_TK.numel():
        ok = (expert_ids_TK.min() >= 0) & (expert_ids_TK.max() < num_experts)
        check_values(ok, f"permute: expert ids must lie in [0, {num_experts})")
    if use_triton(x_TD):
        from eprt.kernels.permute_triton import permute_triton

        return permute_triton(x_TD, expert_ids_TK, num_experts)
    return permute_torch(x_TD, expert_ids_TK, num_experts)


def combine(y_sorted: torch.Tensor, order: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    """Inverse of `permute`: sum_k weights[t, k] * y[t, k] in fp32, k in order. Returns fp32 [T, D].

    Each output element is ((0 + w0*y0) + w1*y1) + ..., so a token's sum does not depend on
    where its copies sat in y_sorted, nor on which rank computed them.
    """
    if y_sorted.dim() != 2 or weights_TK.dim() != 2 or order.shape != (y_sorted.shape[0],):
        raise ValueError(
            f"combine wants y_sorted [T*K, D], order [T*K], weights [T, K], got "
            f"{tuple(y_sorted.shape)}, {tuple(order.shape)}, {tuple(weights_TK.shape)}"
        )
    if weights_TK.numel() != y_sorted.shape[0]:
        raise ValueError(f"combine: weights {tuple(weights_TK.shape)} do not match {y_sorted.shape[0]} rows")
    if use_triton(y_sorted):
        from eprt.kernels.permute_triton import combine_triton

        return combine_triton(y_sorted, order, weights_TK)
    return combine_torch(y_sorted, order, weights_TK)


# index_select rather than x[index]: on CPU, advanced indexing of bf16 rows runs ~10x slower.
def permute_torch(x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, num_experts: int):
    order, tokens_per_expert = sort_by_expert(expert_ids_TK, num_experts)
    return x_TD.index_select(0, order // expert_ids_TK.shape[1]), tokens_per_expert, order


# Tokens a piece of the CPU combine sums: its copies' fp32 temporaries stay small (fresh pages
# for a whole step's copies cost more than the sums), and a step still makes a few pieces a worker.
# Four operations per piece and k: with 64 tokens a piece the workers spent more time waiting on
# each other (Python's lock) than summing; 256 cut the bench model's combine from 1.1 s to 0.85 s.
COMBINE_TOKENS = 256


def combine_torch(y_sorted: torch.Tensor, order: torch.Tensor, weights_TK: torch.Tensor) -> torch.Tensor:
    T, K = weights_TK.shape
    slot_TK = slots(order).view(T, K)
    w_TK = weights_TK.float()
    out = torch.zeros(T, y_sorted.shape[1], dtype=torch.float32, device=y_sorted.device)

    # each product and each sum rounds once, wherever the token sits: pieces of tokens give the
    # bits of one pass over all of them
    def tokens(ab: tuple[int, int], _) -> None:
        a, b = ab
        out_t = out[a:b]
        for k in range(K):
            out_t += w_TK[a:b, k, None] * y_sorted.index_select(0, slot_TK[a:b, k]).float()

    step = COMBINE_TOKENS if y_sorted.device.type == "cpu" else max(T, 1)
    for_each([(a, min(a + step, T)) for a in range(0, T, step)], lambda: None, tokens, y_sorted.device)
    return out
