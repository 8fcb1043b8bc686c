"""Each router against a plain per-token loop written here: Python-level selection, ties to the lower id."""

import pytest
import torch

from eprt.models.router import sigmoid_grouped_topk, softmax_topk


def best(scores: list[float], k: int, among=None) -> list[int]:
    """The k best indices (from `among`, default all), higher score first, equal scores by lower index."""
    among = range(len(scores)) if among is None else among
    return sorted(among, key=lambda i: (-scores[i], i))[:k]


def softmax_loop(logits: torch.Tensor, k: int, renormalize: bool):
    ids, weights = [], []
    for row in logits.float():
        p = torch.softmax(row, dim=-1)
        chosen = best(p.tolist(), k)
        w = p[chosen]
        if renormalize:
            w = w / w.sum()
        ids.append(chosen)
        weights.append(w)
    return torch.tensor(ids), torch.stack(weights)


def sigmoid_loop(
    logits: torch.Tensor, bias: torch.Tensor, k: int, n_group: int, topk_group: int, renormalize: bool, scaling: float
):
    E = logits.shape[1]
    per = E // n_group
    ids, weights = [], []
    for row in logits.float():
        s = torch.sigmoid(row)
        choice = s + bias  # fp32, as the router computes it
        group_score = []
        for g in range(n_group):
            a, b = best(choice.tolist(), 2, among=range(g * per, (g + 1) * per))
            group_score.append((choice[a] + choice[b]).item())
        kept = best(group_score, topk_group)
        candidates = [e for g in kept for e in range(g * per, (g + 1) * per)]
        chosen = best(choice.tolist(), k, among=candidates)
        w = s[chosen]
        if renormalize:
            w = w / (w.sum() + 1e-20)
        ids.append(chosen)
        weights.append(w * scaling)
    return torch.tensor(ids), torch.stack(weights)


def assert_same_routing(got, want):
    (ids, w), (ref_ids, ref_w) = got, want
    assert ids.dtype == torch.int64 and w.dtype == torch.float32
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(w, ref_w, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("coarse", [False, True], ids=["random", "many-ties"])
def test_softmax_topk_random(renormalize, coarse):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(64, 16, generator=g) * 2
    if coarse:  # values on a grid of 0.5: many exact ties, also across the k boundary
        logits = (logits * 2).round() / 2
    got = softmax_topk(logits, 4, renormalize)
    assert_same_routing(got, softmax_loop(logits, 4, renormalize))
    if renormalize:
        torch.testing.assert_close(got[1].sum(-1), torch.ones(64))
    else:
        assert (got[1].sum(-1) < 1).all()


def test_softmax_topk_ties_go_to_lower_id():
    logits = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 0.0], [2.0, 2.0, 2.0, 2.0, 2.0, 2.0]])
    ids, w = softmax_topk(logits, 3, renormalize=True)
    assert ids.tolist() == [[1, 2, 3], [0, 1, 2]]
    torch.testing.assert_close(w, torch.full((2, 3), 1 / 3))


@pytest.mark.parametrize("n_group,topk_group,k", [(1, 1, 4), (4, 2, 4), (8, 3, 2), (4, 4, 6)])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("coarse", [False, True], ids=["random", "many-ties"])
def test_sigmoid_grouped_topk_random(n_group, topk_group, k, renormalize, coarse):
    g = torch.Generator().manual_seed(2)
    E = 16
    logits = torch.randn(64, E, generator=g) * 2
    bias = torch.randn(E, generator=g) * 0.2
    if coarse:
        logits, bias = (logits * 2).round() / 2, (bias * 8).round() / 8
    got = sigmoid_grouped_topk(logits, bias, k, n_group, topk_group, renormalize, 2.5)
    assert_same_routing(got, sigmoid_loop(logits, bias, k, n_group, topk_group, renormalize, 2.5))


def test_sigmoid_groups_and_bias_change_selection():
    """Four groups of two experts. Expert 0 has the best score but group 0's sum of its top two
    is the worst, so with two groups kept expert 0 is dropped; the bias moves expert 7 in front
    of expert 6 for selection while the weights stay the unbiased scores."""
    s = torch.tensor([[0.99, 0.01, 0.60, 0.55, 0.70, 0.50, 0.65, 0.64]])
    logits = torch.logit(s)
    no_bias = torch.zeros(8)
    ids, _ = sigmoid_grouped_topk(logits, no_bias, 2, n_group=1, topk_group=1, renormalize=False, scaling=1.0)
    assert ids.tolist() == [[0, 4]]  # without groups the single best expert wins
    ids, w = sigmoid_grouped_topk(logits, no_bias, 2, n_group=4, topk_group=2, renormalize=False, scaling=1.0)
    assert ids.tolist() == [[4, 6]]  # groups 2 (1.20) and 3 (1.29) kept, group 0 (1.00) dropped
    bias = torch.tensor([0, 0, 0, 0, 0, 0, 0, 0.05])
    ids, w = sigmoid_grouped_topk(logits, bias, 2, n_group=4, topk_group=2, renormalize=True, scaling=2.0)
    assert ids.tolist() == [[4, 7]]  # expert 7 chosen at 0.64 + 0.05 = 0.69 over expert 6 at 0.65
    torch.testing.assert_close(w, torch.tensor([[0.70, 0.64]]) / (0.70 + 0.64) * 2.0)


def test_sigmoid_group_that_holds_the_top_experts():
    """All of the k best experts sit in one group: they are chosen together, whatever the other
    kept group holds; tied group scores go to the lower group."""
    s = torch.tensor([[0.9, 0.8, 0.7, 0.6, 0.1, 0.1, 0.1, 0.1, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2, 0.2]])
    ids, _ = sigmoid_grouped_topk(
        torch.logit(s), torch.zeros(16), 4, n_group=4, topk_group=2, renormalize=True, scaling=1.0
    )
    assert ids.tolist() == [[0, 1, 2, 3]]
    # groups 2 and 3 tie (0.4 each) for the second place: group 2 is kept, so its experts 8, 9
    # (lowest ids among the tied 0.2s) follow
    ids, _ = sigmoid_grouped_topk(
        torch.logit(s), torch.zeros(16), 6, n_group=4, topk_group=2, renormalize=True, scaling=1.0
    )
    assert ids.tolist() == [[0, 1, 2, 3, 8, 9]]
