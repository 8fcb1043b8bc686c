"""Token dispatch across the ep group: tokens travel to their experts' ranks and back.

A dispatcher is called as `dispatcher(x_TD, topk_ids_TK, topk_weights_TK, experts) -> y_TD`:
topk ids are global expert ids, and `experts` holds experts [first, first + count) with
`experts(x_sorted, tokens_per_local_expert) -> y_sorted` over rows sorted by local expert.
The result is the fp32 weighted sum of each token's top-k expert outputs, summed in k order
wherever each output was computed, so it is the single-process result whenever the experts
are batch invariant.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from eprt.kernels import combine, permute
from eprt.parallel.state import ParallelState


class EPDispatcher:
    """All-to-all token dispatch over `state`'s ep group. Every rank of the group must call it
    for every MoE layer, even with no tokens: the exchanges are collective.
    """

    def __init__(self, state: ParallelState):
        self.group, self.ep_size, self.ep_rank = state.ep_group, state.ep_size, state.ep_rank

    def __call__(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor,
                 topk_weights_TK: torch.Tensor, experts) -> torch.Tensor:
        E, L = experts.num_experts, experts.count
        if L * self.ep_size != E or experts.first != self.ep_rank * L:
            raise ValueError(
                f"ep rank {self.ep_rank} of {self.ep_size} must hold experts "
                f"[{self.ep_rank * E // self.ep_size}, {(self.ep_rank + 1) * E // self.ep_size}) "
                f"of {E}, but holds [{experts.first}, {experts.first + L})")
        # Rows sorted by global expert are grouped by destination rank, since rank r holds
        # the r-th block of experts: [dest rank][local expert].
        x_sorted, tokens_per_expert_E, order = permute(x_TD, topk_ids_TK, E)
        if tokens_per_expert_E.numel() != E:
            raise ValueError(f"topk ids reach expert {tokens_per_expert_E.numel() - 1}, "
                             f"but the layer has {E} experts")
        if self.ep_size == 1:
            y_sorted = experts(x_sorted, tokens_per_expert_E)
        else:
            y_sorted = self._exchange(x_sorted, tokens_per_expert_E, experts)
        if x_TD.shape[0] == 0:
            # combine cannot infer the width of zero rows; there is nothing to sum.
            return y_sorted.new_zeros(0, y_sorted.shape[1], dtype=torch.float32)
        return combine(y_sorted, order, topk_weights_TK)

    def _exchange(self, x_sorted, tokens_per_expert_E, experts) -> torch.Tensor:
        """Run this rank's routed rows on their owners' experts; return results in x_sorted's order."""
        ep, L = self.ep_size, experts.count
        sent_SL = tokens_per_expert_E.view(ep, L)
        recv_SL = torch.empty_like(sent_SL)  # [source rank][local expert]
        dist.all_to_all_single(recv_SL, sent_SL, group=self.group)
        send_splits = sent_SL.sum(1).tolist()
        recv_splits = recv_SL.sum(1).tolist()

        x_recv = _all_to_all_rows(x_sorted, recv_splits, send_splits, self.group)
        to_local = source_to_expert_order(recv_SL)
        y_local = experts(x_recv[to_local], recv_SL.sum(0))
        y_recv = torch.empty_like(y_local)
        y_recv[to_local] = y_local
        return _all_to_all_rows(y_recv, send_splits, recv_splits, self.group)


def source_to_expert_order(counts_SL: torch.Tensor) -> torch.Tensor:
    """Row gather that turns [source rank][local expert] blocks into [local expert][source rank].

    counts_SL[s, l] rows of local expert l came from rank s. Within a block rows keep their order.
    """
    S, L = counts_SL.shape
    counts = counts_SL.reshape(-1)
    starts_SL = (torch.cumsum(counts, 0) - counts).view(S, L)
    counts_LS, starts_LS = counts_SL.T.reshape(-1), starts_SL.T.reshape(-1)
    n = int(counts.sum())
    block_of_row = torch.repeat_interleave(torch.arange(S * L, device=counts.device), counts_LS, output_size=n)
    first_row_LS = torch.cumsum(counts_LS, 0) - counts_LS
    offset_in_block = torch.arange(n, device=counts.device) - first_row_LS[block_of_row]
    return starts_LS[block_of_row] + offset_in_block


def _all_to_all_rows(x: torch.Tensor, out_splits: list[int], in_splits: list[int],
                     group: dist.ProcessGroup) -> torch.Tensor:
    """Exchange rows with uneven (possibly zero) splits, as raw bytes: gloo refuses float8, and
    the bytes of any dtype travel unchanged."""
    x = x.contiguous()
    out = torch.empty(sum(out_splits), *x.shape[1:], dtype=x.dtype, device=x.device)
    dist.all_to_all_single(out.view(torch.uint8), x.view(torch.uint8), out_splits, in_splits,
                           group=group)
    return out
