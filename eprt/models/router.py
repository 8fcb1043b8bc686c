"""Routers: which k experts each token goes to, and with what weight.

Selection is a stable descending sort, so among exactly equal scores the lower expert id wins,
on every device and for every batch (torch.topk leaves the choice among ties unspecified).
"""

from __future__ import annotations

import torch
from torch import nn

from eprt.models.layers import linear


def top_k(scores_TE: torch.Tensor, k: int) -> torch.Tensor:
    """Indices [T, k] of the k largest scores per row, best first, ties to the lower index."""
    return torch.sort(scores_TE, dim=-1, descending=True, stable=True).indices[:, :k]


def softmax_topk(logits_TE: torch.Tensor, k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE: p = softmax(logits) over all experts in fp32, the top k, optionally divided by their sum."""
    p = torch.softmax(logits_TE.float(), dim=-1)
    ids = top_k(p, k)
    w = p.gather(1, ids)
    if renormalize:
        w = w / w.sum(dim=-1, keepdim=True)
    return ids, w


def in_best_groups(choice_TE: torch.Tensor, n_group: int, topk_group: int) -> torch.Tensor:
    """`choice_TE` with every expert outside each token's best `topk_group` of `n_group` equal
    groups (ranked by the sum of their two best scores) at -inf, so that no top-k picks it."""
    if topk_group >= n_group:
        return choice_TE
    T, E = choice_TE.shape
    by_group = choice_TE.view(T, n_group, E // n_group)
    group_scores = by_group.topk(2, dim=-1).values.sum(dim=-1)
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, top_k(group_scores, topk_group), True)
    return by_group.masked_fill(~keep[:, :, None], float("-inf")).view(T, E)


def softmax_grouped_topk(
    logits_TE: torch.Tensor, k: int, n_group: int, topk_group: int, renormalize: bool, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V2's group-limited greedy routing (Mistral-Small-4): p = softmax(logits) over all
    experts, rounded to the logits' dtype as the reference computes it there; p chooses (groups
    ranked by the sum of their two best, the best topk_group kept, then the top k inside them);
    the weights are the chosen p, divided by their sum + 1e-20 when renormalizing, times `scaling`."""
    p = torch.softmax(logits_TE.float(), dim=-1).to(logits_TE.dtype).float()
    ids = top_k(in_best_groups(p, n_group, topk_group), k)
    w = p.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, w * scaling


def sigmoid_grouped_topk(
    logits_TE: torch.Tensor,
    bias_E: torch.Tensor,
    k: int,
    n_group: int,
    topk_group: int,
    renormalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3 noaux_tc: s = sigmoid(logits); s + bias chooses (groups ranked by the sum of
    their two best, the best topk_group kept, then the top k inside them); the weights are the
    unbiased s, divided by their sum + 1e-20 when renormalizing, times `scaling`. All fp32."""
    s = torch.sigmoid(logits_TE.float())
    ids = top_k(in_best_groups(s + bias_E.float(), n_group, topk_group), k)
    w = s.gather(1, ids)
    if renormalize:
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
    return ids, w * scaling


class SoftmaxRouter(nn.Module):
    def __init__(self, num_experts: int, hidden: int, k: int, renormalize: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.k, self.renormalize = k, renormalize

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # The reference computes the logits in the model dtype and rounds the weights back to it
        # before the experts use them; both casts are kept so that bf16 runs route and weigh alike.
        ids, w = softmax_topk(linear(x_TD, self.weight), self.k, self.renormalize)
        return ids, w.to(x_TD.dtype).float()


class SigmoidGroupRouter(nn.Module):
    """Its weight and correction bias stay fp32 whatever the model dtype, as in the reference."""

    def __init__(
        self, num_experts: int, hidden: int, k: int, n_group: int, topk_group: int, renormalize: bool, scaling: float
    ):
        super().__init__()
        assert num_experts % n_group == 0 and topk_group <= n_group, (num_experts, n_group, topk_group)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.empty(num_experts))
        self.k, self.n_group, self.topk_group = k, n_group, topk_group
        self.renormalize, self.scaling = renormalize, scaling

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = linear(x_TD.float(), self.weight.float())
        return sigmoid_grouped_topk(
            logits, self.e_score_correction_bias, self.k, self.n_group, self.topk_group, self.renormalize, self.scaling
        )


class SoftmaxGroupRouter(nn.Module):
    """`softmax_grouped_topk` over logits in the model dtype; the weights rounded to it, as the
    reference's are before the experts use them."""

    def __init__(
        self, num_experts: int, hidden: int, k: int, n_group: int, topk_group: int, renormalize: bool, scaling: float
    ):
        super().__init__()
        assert num_experts % n_group == 0 and topk_group <= n_group, (num_experts, n_group, topk_group)
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.k, self.n_group, self.topk_group = k, n_group, topk_group
        self.renormalize, self.scaling = renormalize, scaling

    def forward(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ids, w = softmax_grouped_topk(
            linear(x_TD, self.weight), self.k, self.n_group, self.topk_group, self.renormalize, self.scaling
        )
        return ids, w.to(x_TD.dtype).float()
