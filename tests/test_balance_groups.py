"""AWQ's balance groups as the models declare them (eprt.models.balance): a group behind a norm
names every module that reads the norm's output, and only those, as the forward pass shows them.
A reader left out of its group would be scaled by nothing while the norm is divided: the model
would compute something else after the fold."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eprt.families import model_class, parse_hf_config
from eprt.models.balance import BalanceGroup
from eprt.models.decoder import DecoderLayer, Embedding
from eprt.models.layers import RMSNorm
from eprt.models.moe import Experts
from eprt.quant.algorithms.awq.groups import layer_groups
from eprt.testing.tiny import distinct_models, tiny_config


def readers_seen(model: nn.Module, norms: set[nn.Module]) -> dict[nn.Module, set[nn.Module]]:
    """{norm: the weight-holding modules whose input is its output (the same storage)} in one
    forward pass. Every output is held to the end, so no later tensor reuses its storage."""
    owner, held, seen = {}, [], {n: set() for n in norms}

    def norm_out(module, _args, out):
        held.append(out)
        owner[out.untyped_storage().data_ptr()] = module

    def weight_in(module, args):
        norm = owner.get(args[0].untyped_storage().data_ptr())
        if norm is not None:
            seen[norm].add(module)

    hooks = [n.register_forward_hook(norm_out) for n in norms]
    for m in model.modules():
        w = m._parameters.get("weight")
        if w is not None and w.dim() == 2 and not isinstance(m, Embedding):
            hooks.append(m.register_forward_pre_hook(weight_in))
    with torch.no_grad():
        model(torch.randint(0, model_config(model).vocab_size, (2, 5)))
    for h in hooks:
        h.remove()
    return seen


def model_config(model: nn.Module):
    return getattr(model, "config", None) or model.language_model.config


@pytest.mark.parametrize("family", distinct_models())
def test_a_norms_group_holds_every_module_that_reads_it(family):
    c = parse_hf_config(tiny_config(family))
    torch.manual_seed(0)
    model = model_class(c)(c)
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    layers = [m for m in model.modules() if isinstance(m, DecoderLayer)]
    declared = {
        g.source: {m for m in g.readers if not isinstance(m, Experts)}  # experts read a permuted copy
        for layer in layers
        for g in layer.balance_groups()
        if isinstance(g, BalanceGroup) and isinstance(g.source, RMSNorm)
    }
    assert declared, f"{family}: no group behind a norm"
    seen = readers_seen(model, set(declared))
    assert {n: seen[n] for n in declared} == declared
    # quantization finds each group's modules inside its layer, by name
    names = {name for layer in layers for g in layer_groups(layer, "")[0] for name, _ in (g.divided, *g.readers)}
    assert names <= {name for layer in layers for name, _ in layer.named_modules()}
