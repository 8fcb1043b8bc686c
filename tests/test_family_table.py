"""The family table: every family folder is registered, and each entry runs its configs with the
model class it names."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
import torch

import eprt.families
from eprt.families import FAMILIES, model_class, parse_hf_config
from eprt.families.family import Family
from eprt.testing.tiny import tiny_config

FOLDERS = sorted(p.parent.name for p in Path(eprt.families.__file__).parent.glob("*/__init__.py"))


def test_every_family_folder_is_in_the_table():
    """A folder's entries (each `Family` its __init__ holds) are all in FAMILIES, and the table
    holds nothing else: a folder left out of the one line of registration is caught here."""
    entries = {
        value.name
        for folder in FOLDERS
        for value in vars(importlib.import_module(f"eprt.families.{folder}")).values()
        if isinstance(value, Family)
    }
    assert entries == {f.name for f in FAMILIES}
    assert len({f.name for f in FAMILIES}) == len(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_config_runs_with_the_model_class_of_its_entry(family):
    c = parse_hf_config(tiny_config(family.name))
    assert c.family == family.name
    assert model_class(c) is family.model


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_a_family_whose_layout_runs_mtp_layers_names_their_model(family):
    """The MTP layers a recipe may quantize (Layout.mtp) are built from the entry's mtp_model."""
    c = parse_hf_config(tiny_config(family.name))
    if family.layout(c).mtp:
        assert family.mtp_model is not None
        with torch.device("meta"):
            mtp = family.mtp_model(c)
        prefix = family.mtp_layer(c, 0)
        want = {s.name[len(prefix) :] for s in family.layout(c).mtp if s.name.startswith(prefix)}
        # and the model's own tensors it shares (DeepSeek-V4's embedding)
        assert set(mtp.state_dict()) == want | {n.removeprefix("model.") for n in family.mtp_shared}
