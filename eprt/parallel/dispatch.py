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

from eprt.kernels import combine, permute
from eprt.parallel.placement import ExpertPlacement
from eprt.parallel.state import ParallelState


class EPDispatcher:
    """All-to-all token dispatch over `state`'s ep group. Every rank of the group must call it
    for every MoE layer, even with no tokens: the exchanges are collective.
    """

    def __init__(self, state: ParallelState):
        self.state, self.ep_size = state, state.ep_size

    def __call__(
        self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, experts
    ) -> torch.Tensor:
        E = experts.num_experts
        _check_holds(self.state.placement(E), experts)
        # Rows sorted by global expert are grouped by destination rank, since rank r holds
        # the r-th block of experts: [dest rank][local expert].
        x_sorted, tokens_per_expert_E, order = permute(x_TD, topk_ids_TK, E)
        if tokens_per_expert_E.numel() != E:
            raise ValueError(f"topk ids reach expert {tokens_per_expert_E.numel() - 1}, but the layer has {E} experts")
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
        sent_PL = tokens_per_expert_E.view(ep, L)
        recv_PL = torch.empty_like(sent_PL)  # [source rank][local expert]
        self.state.all_to_all_single(recv_PL, sent_PL, over="ep")
        send_splits = sent_PL.sum(1).tolist()
        recv_splits = recv_PL.sum(1).tolist()

        x_recv = _all_to_all_rows(x_sorted, recv_splits, send_splits, self.state, "ep")
        to_local = source_to_expert_order(recv_PL)
        y_local = experts(x_recv[to_local], recv_PL.sum(0))
        y_recv = torch.empty_like(y_local)
        y_recv[to_local] = y_local
        return _all_to_all_rows(y_recv, send_splits, recv_splits, self.state, "ep")


def _check_holds(place: ExpertPlacement, experts) -> None:
    """Refuse experts other than the ones `place` gives this rank: the exchanges assume them."""
    if (experts.first, experts.count) != place.range:
        first, count = place.range
        raise ValueError(
            f"ep rank {place.ep_rank} of {place.ep_size} must hold experts [{first}, {first + count}) "
            f"of {place.num_experts}, but holds [{experts.first}, {experts.first + experts.count})"
        )


def source_to_expert_order(counts_PL: torch.Tensor) -> torch.Tensor:
    """Row gather that turns [source rank][local expert] blocks into [local expert][source rank].

    counts_PL[p, l] rows of local expert l came from peer rank p. Within a block rows keep their order.
    """
    P, L = counts_PL.shape
    counts = counts_PL.reshape(-1)
    starts_PL = (torch.cumsum(counts, 0) - counts).view(P, L)
    counts_LP, starts_LP = counts_PL.T.reshape(-1), starts_PL.T.reshape(-1)
    n = int(counts.sum())
    block_of_row = torch.repeat_interleave(torch.arange(P * L, device=counts.device), counts_LP, output_size=n)
    first_row_LP = torch.cumsum(counts_LP, 0) - counts_LP
    offset_in_block = torch.arange(n, device=counts.device) - first_row_LP[block_of_row]
    return starts_LP[block_of_row] + offset_in_block


def _all_to_all_rows(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], state: ParallelState, over: str = "dp"
) -> torch.Tensor:
    """Exchange rows with uneven (possibly zero) splits, as raw bytes: gloo refuses float8, and
    the bytes of any dtype travel unchanged."""
    x = x.contiguous()
    out = torch.empty(sum(out_splits), *x.shape[1:], dtype=x.dtype, device=x.device)
    state.all_to_all_single(out.view(torch.uint8), x.view(torch.uint8), out_splits, in_splits, over)
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

    def __call__(
        self,
        x_TD: torch.Tensor,
        topk_ids_TK: torch.Tensor,
        topk_weights_TK: torch.Tensor,
        key_TK: torch.Tensor,
        unit_T: torch.Tensor,
        units: tuple[int, int],
        experts,
    ) -> torch.Tensor:
        """The fp32 weighted sum of each token's top-k expert outputs, k in order.

        key_TK: each copy's global sort key (sequence, position, k), below the keyspace;
        unit_T: each token's global group; units: (first, count) of the groups this step holds
        (the same on every rank)."""
        st, E, L = self.state, experts.num_experts, experts.count
        place = st.placement(E)
        _check_holds(place, experts)
        first_unit, U = units
        K = topk_ids_TK.shape[1]
        ids_R = topk_ids_TK.reshape(-1)
        unit_R = (unit_T - first_unit).repeat_interleave(K)
        # the owner sorts what it receives by (local expert, unit, key): one int64 says it all
        sort_key_R = (place.local_of(ids_R) * U + unit_R) * self.keyspace + key_TK.reshape(-1)
        if st.world == 1:
            # nothing travels: the copies go into unit order by one gather, and back by the combine
            order_R = torch.argsort(sort_key_R)
            y_sent = _units(
                x_TD.index_select(0, order_R // K), sort_key_R.index_select(0, order_R), L, U, self.keyspace, experts
            )
        else:
            dest_R = place.owner_of(ids_R, unit_R + first_unit)
            order_R = torch.argsort(dest_R, stable=True)
            x_sent = x_TD.index_select(0, order_R // K)
            x_recv, key_recv, send_splits, recv_splits = self._send(dest_R, x_sent, sort_key_R.index_select(0, order_R))
            y_recv = _run_units(x_recv, key_recv, L, U, self.keyspace, experts)
            y_sent = _all_to_all_rows(y_recv, send_splits, recv_splits, st)
            # the rows that stay on this rank cross no wire
            self.bytes_sent += (y_recv.shape[0] - recv_splits[st.rank]) * y_recv.shape[1] * y_recv.element_size()
        if x_TD.shape[0] == 0:
            return y_sent.new_zeros(0, y_sent.shape[1], dtype=torch.float32)
        return combine(y_sent, order_R, topk_weights_TK)

    def _send(
        self, dest_R: torch.Tensor, x_sent: torch.Tensor, key_sent: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[int], list[int]]:
        """Rows sorted by destination rank (dest_R) to their ranks, each with its int64 key:
        (rows received, their keys, rows sent to each rank, rows received from each rank),
        counting the bytes that cross the wire (the rows that stay on this rank do not)."""
        st = self.state
        sent = torch.bincount(dest_R, minlength=st.world)
        recv = torch.empty_like(sent)
        st.all_to_all_single(recv, sent)
        send_splits, recv_splits = sent.tolist(), recv.tolist()
        x_recv = _all_to_all_rows(x_sent, recv_splits, send_splits, st)
        key_recv = _all_to_all_rows(key_sent[:, None], recv_splits, send_splits, st)[:, 0]
        self.bytes_sent += (x_sent.shape[0] - send_splits[st.rank]) * (x_sent.shape[1] * x_sent.element_size() + 8)
        return x_recv, key_recv, send_splits, recv_splits

    def every_expert_rows(
        self, x_TD: torch.Tensor, key_T: torch.Tensor, unit_T: torch.Tensor, units: tuple[int, int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """For statistics over every expert (--calibrate-all-experts): the rows this rank runs
        through each expert it holds, sorted by (unit, key), and the row count of each of the
        step's units [U].

        The all-experts unit (expert e, group g) holds every token of group g, in key order
        (sequence, position), and is computed by the rank that computes the routed unit (e, g):
        so each token goes once to every ep rank of edp replica g % edp, which runs it through
        all its experts. key_T: each token's global key, below the keyspace. Every rank must call
        it for every step, even with no rows: the exchanges are collective."""
        st, P = self.state, self.state.ep_size
        first_unit, U = units
        dest_R = (unit_T % st.edp_size * P)[:, None].add(torch.arange(P, device=unit_T.device)).view(-1)
        order_R = torch.argsort(dest_R, stable=True)
        x_sent = x_TD.index_select(0, order_R // P)
        key_sent = ((unit_T - first_unit) * self.keyspace + key_T).index_select(0, order_R // P)
        if st.world == 1:
            x_recv, key_recv = x_sent, key_sent
        else:
            x_recv, key_recv, _, _ = self._send(dest_R, x_sent, key_sent)
        order = torch.argsort(key_recv)
        rows_per_unit_U = torch.bincount(key_recv // self.keyspace, minlength=U)
        return x_recv.index_select(0, order), rows_per_unit_U


def _run_units(x_R: torch.Tensor, sort_key_R: torch.Tensor, L: int, U: int, keyspace: int, experts) -> torch.Tensor:
    """The rows this rank received, through their units, returned in the order they came."""
    order = torch.argsort(sort_key_R)
    y_sorted = _units(x_R.index_select(0, order), sort_key_R.index_select(0, order), L, U, keyspace, experts)
    y_R = torch.empty_like(y_sorted)
    y_R[order] = y_sorted
    return y_R


def _units(x_sorted: torch.Tensor, key_sorted: torch.Tensor, L: int, U: int, keyspace: int, experts) -> torch.Tensor:
    """Rows already in their sort keys' order (local expert, unit, key) through their units."""
    rows_per_unit_LU = torch.bincount(key_sorted // keyspace, minlength=L * U).view(L, U)
    return experts.forward_units(x_sorted, rows_per_unit_LU)
