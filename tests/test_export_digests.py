"""bench/export_digests.py's wide tiny models: each family's holds no Linear whose input dim a
weight format's blocks fail to fill, so its matrix has no format-by-family gap to record as a
refusal (the default tiny models' hidden size of 64 leaves INT4's groups of 128 unfilled)."""

import pytest

from bench.export_digests import FAMILIES, wide
from eprt.families import parse_hf_config, reader_for
from eprt.quant.feasibility import module_of
from eprt.quant.formats import WEIGHT_FORMATS
from eprt.testing.tiny import tiny_config


def unfit(family: str, **overrides) -> list[str]:
    """Each quantizable weight of the family's tiny model (with `overrides`) and the formats that cannot take it."""
    cfg = parse_hf_config(tiny_config(family, **overrides), f"tiny {family}")
    layout = reader_for(cfg.model_type, "tiny").layout(cfg)
    modules = {**layout.linear_modules(), **layout.linear_modules(mtp=True)}
    return [
        f"{spec.name} (input dim {spec.shape[-1]}): {', '.join(bad)}"
        for spec in (*layout.specs, *layout.mtp)
        if module_of(spec) in modules
        for bad in [[f.name for f in WEIGHT_FORMATS.values() if f.unfit_input_dim(spec.shape[-1])]]
        if bad
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_every_format_takes_every_weight_of_the_wide_tiny_model(family):
    assert unfit(family), f"{family}'s default tiny model already fits every format: the wide one adds nothing"
    assert unfit(family, **wide(family)) == []
