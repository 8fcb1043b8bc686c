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


class UnitDispatcher:
    """Token dispatch to canonical work units, over the whole world.

    A work unit is (routed expert, group of calibration sequences): its rows are the copies of
    the group's tokens routed to the expert, sorted by (sequence, position, k), and it is
    computed by exactly one rank, the holder of the expert in edp replica `group % edp`, as one
    matmul of its own. Which rows a matmul sees is then a function of the data alone, never of
    the world, ep, batch or chunk, and any deterministic kernel gives every layout the same bits.
    Every rank must call it for every step, even with no rows: the exchanges are collective.
    """

    def __init__(self, state: ParallelState, keyspace: int):
        # keyspace bounds the copies' sort keys: (sequences x positions x k) of the whole run
        self.state, self.keyspace = state, keyspace
        self.bytes_sent = 0  # rows and keys this rank sent, both ways, for the log

    def __call__(self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor,
                 key_TK: torch.Tensor, unit_T: torch.Tensor, units: tuple[int, int], experts) -> torch.Tensor:
        """The fp32 weighted sum of each token's top-k expert outputs, k in order.

        key_TK: each copy's global sort key (sequence, position, k), below the keyspace;
        unit_T: each token's global group; units: (first, count) of the groups this step holds
        (the same on every rank)."""
        st, E, L = self.state, experts.num_experts, experts.count
        first_unit, U = units
        K = topk_ids_TK.shape[1]
        ids_R = topk_ids_TK.reshape(-1)
        unit_R = (unit_T - first_unit).repeat_interleave(K)
        owner_ep_R = ids_R // L
        dest_R = ((unit_R + first_unit) % st.edp_size) * st.ep_size + owner_ep_R
        # the owner sorts what it receives by (local expert, unit, key): one int64 says it all
        sort_key_R = ((ids_R % L) * U + unit_R) * self.keyspace + key_TK.reshape(-1)
        order_R = torch.argsort(dest_R, stable=True)
        x_sent = x_TD.index_select(0, order_R // K)
        key_sent = sort_key_R.index_select(0, order_R)
        if st.world == 1:
            y_sent = _run_units(x_sent, key_sent, L, U, self.keyspace, experts)
        else:
            sent = torch.bincount(dest_R, minlength=st.world)
            recv = torch.empty_like(sent)
            dist.all_to_all_single(recv, sent, group=st.dp_group)
            send_splits, recv_splits = sent.tolist(), recv.tolist()
            x_recv = _all_to_all_rows(x_sent, recv_splits, send_splits, st.dp_group)
            key_recv = _all_to_all_rows(key_sent[:, None], recv_splits, send_splits, st.dp_group)[:, 0]
            y_recv = _run_units(x_recv, key_recv, L, U, self.keyspace, experts)
            y_sent = _all_to_all_rows(y_recv, send_splits, recv_splits, st.dp_group)
            own = sent[st.rank].item()  # rows that stay on this rank cross no wire
            row_bytes = x_sent.shape[1] * x_sent.element_size()
            self.bytes_sent += (x_sent.shape[0] - own) * (row_bytes + 8) + (y_recv.shape[0] - own) * row_bytes
        if x_TD.shape[0] == 0:
            return y_sent.new_zeros(0, y_sent.shape[1], dtype=torch.float32)
        return combine(y_sent, order_R, topk_weights_TK)


def _run_units(x_R: torch.Tensor, sort_key_R: torch.Tensor, L: int, U: int, keyspace: int, experts) -> torch.Tensor:
    """The rows this rank received, through their units, returned in the order they came."""
    order = torch.argsort(sort_key_R)
    unit_of_row = sort_key_R.index_select(0, order) // keyspace
    rows_per_unit_LU = torch.bincount(unit_of_row, minlength=L * U).view(L, U)
    y_sorted = experts.forward_units(x_R.index_select(0, order), rows_per_unit_LU)
    y_R = torch.empty_like(y_sorted)
    y_R[order] = y_sorted
    return y_R
