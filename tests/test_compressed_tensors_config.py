"""config.json's quantization_config in the compressed-tensors layout, built from eprt's own table
of the library's schemes (eprt.hf.compressed_tensors_schemes), is exactly what compressed-tensors'
classes build from the same inputs, key order included (so config.json is the same bytes), and the
library reads it back unchanged: for every shipped recipe's formats, every format alone, every two
formats together and all of them, without a KV cache and with an FP8 one (the layout has no NVFP4
KV-cache scheme: the export refuses it). And eprt's rule for `ignore` and `targets` matches names
as the library's `match_name` does."""

import itertools
import json

import pytest

from eprt.hf import compressed_tensors_export as ct
from eprt.quant.formats import WEIGHT_FORMATS, WeightFormat, weight_format
from eprt.quant.formats.kv import kv_cache_format
from eprt.quant.recipe import available, load_recipe
from eprt.storage.encodings import matches

pytest.importorskip("compressed_tensors")  # the oracle
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationStatus,
    preset_name_to_scheme,
)
from compressed_tensors.utils.match import match_name  # noqa: E402

IGNORE = ["lm_head", "model.layers.0.mlp.gate", "re:^model\\.layers\\.3\\."]
FORMAT_SETS = sorted(
    {tuple(load_recipe(name).formats) for name in available()}
    | {tuple(sorted(pair)) for n in (1, 2) for pair in itertools.combinations(WEIGHT_FORMATS, n)}
    | {tuple(sorted(WEIGHT_FORMATS))}
)


def library_config(formats: set[WeightFormat], ignore, kv_cache, targets) -> dict:
    """The quantization_config as compressed-tensors' own classes build it."""
    groups = {}
    for i, fmt in enumerate(sorted(formats, key=lambda f: f.name)):
        scheme = preset_name_to_scheme(fmt.ct_preset, targets[fmt])
        scheme.format = fmt.ct_format
        if fmt.group_size is not None and scheme.weights.group_size != fmt.group_size:
            scheme.weights = scheme.weights.model_copy(update={"group_size": fmt.group_size})
        groups[f"group_{i}"] = scheme
    kv = kv_cache and QuantizationArgs(**kv_cache_format(kv_cache).ct_args)
    qc = QuantizationConfig(
        config_groups=groups,
        format=next(iter(formats)).ct_format if len(formats) == 1 else "mixed-precision",
        quantization_status=QuantizationStatus.COMPRESSED,
        ignore=ignore,
        kv_cache_scheme=kv,
    )
    return qc.model_dump(mode="json")


def targets_of(formats: set[WeightFormat]) -> dict[WeightFormat, list[str]]:
    if len(formats) == 1:
        return {next(iter(formats)): ["Linear"]}
    return {f: [f"re:^model\\.layers\\.\\d+\\.{f.name}$", f"model.layers.0.{f.name}"] for f in formats}


@pytest.mark.parametrize("kv_cache", [None, "fp8"])
@pytest.mark.parametrize("names", FORMAT_SETS, ids="+".join)
def test_the_config_is_what_the_library_builds_and_reads(names, kv_cache):
    formats = {weight_format(n) for n in names}
    targets = targets_of(formats)
    ours = ct.quantization_config(formats, IGNORE, kv_cache, targets)
    want = library_config(formats, IGNORE, kv_cache, targets)
    assert ours == want
    assert json.dumps(ours, indent=2) == json.dumps(want, indent=2)  # key order: config.json's bytes
    assert QuantizationConfig.model_validate(ours).model_dump(mode="json") == ours


NAMES = ["model.layers.10.mlp.experts.3.up_proj", "lm_head", "model.layers.1.self_attn.q_proj", "re:lm_head"]
TARGETS = [
    "lm_head",
    "model.layers.1",  # a prefix is not a name
    "re:lm",  # a regex matches at the start, not the whole name
    "re:head",  # ...and not inside it
    "re:.*experts\\.\\d+\\.up_proj$",
    "re:^model\\.layers\\.1\\.",
    "re:lm_head",
    "RE:lm_head",  # only the lower-case prefix makes a regex
]


def test_names_match_as_the_library_matches_them():
    for name, target in itertools.product(NAMES, TARGETS):
        assert matches(name, [target]) == match_name(name, target), (name, target)
    assert matches("model.layers.0.mlp.down_proj", ["Linear"])  # every compressed module is a Linear
