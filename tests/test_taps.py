"""The model's taps (eprt.models.taps): what quantization may observe or replace, set only for the
context that sets it, never two callers on one point."""

import contextlib

import pytest
import torch

from eprt.models.moe import Experts
from eprt.models.taps import ExpertsTaps, tapped


def experts() -> Experts:
    torch.manual_seed(0)
    e = Experts(num_experts=2, first=0, count=2, hidden=8, width=4)
    for p in e.parameters():
        p.data.normal_()
    return e


@torch.inference_mode()
def test_a_replaced_activation_is_what_the_down_projection_reads_in_both_forwards():
    e = experts()
    x = torch.randn(6, 8)
    tokens_per_expert, rows_per_unit_LU = torch.tensor([4, 2]), torch.tensor([[3, 1], [2, 0]])
    seen = []
    with tapped(e, activation=lambda h: h * 0, routed=lambda x_, h, n: seen.append(h)):
        assert torch.equal(e(x, tokens_per_expert), torch.zeros(6, 8))
        assert torch.equal(e.forward_units(x, rows_per_unit_LU), torch.zeros(6, 8))
    assert all(torch.equal(h, torch.zeros_like(h)) for h in seen) and len(seen) == 2  # observed as replaced
    assert not torch.equal(e(x, tokens_per_expert), torch.zeros(6, 8))  # and set only while the context lasts
    assert e.taps == ExpertsTaps()


def test_a_tap_set_twice_is_refused_and_an_unknown_one_named():
    e = experts()
    with tapped(e, input=lambda x: x):
        with pytest.raises(RuntimeError, match="ExpertsTaps.input of Experts is already set"):
            with tapped(e, input=lambda x: -x):
                pass
        assert e.taps.input is not None  # the refused context cleared nothing
    with pytest.raises(TypeError, match="ExpertsTaps has no tap 'kv'"):
        tapped(e, kv=lambda k, v: (k, v))
    with pytest.raises(TypeError, match="Linear declares no taps"):
        tapped(torch.nn.Linear(2, 2), observe=print)


def test_taps_of_one_stack_leave_in_any_order():
    """The engine removes one pass's taps while another's stay (the quality report's probes
    before the quantized layer's replacements): each context clears only its own points."""
    e = experts()
    probes, quantized = contextlib.ExitStack(), contextlib.ExitStack()
    quantized.enter_context(tapped(e, input=lambda x: x))
    probes.enter_context(tapped(e, units_output=lambda x, rows, y: None))
    probes.close()
    assert e.taps.units_output is None and e.taps.input is not None
    quantized.close()
    assert e.taps == ExpertsTaps()
