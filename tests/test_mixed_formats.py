"""The weight formats mixed by pattern in one recipe, on DeepSeek-V3 (MLA attention, a dense MLP,
shared and routed experts), with every quantized Linear's input dim a multiple of 128 so that each
format can take each module.

- Each module of a mixed export holds exactly the tensors, byte for byte, that the recipe of its
  format alone writes for it (those recipes' own tests hold them to the outside references), and
  the export names nothing else: the modules the mix leaves out are the source's bytes.
- The compressed-tensors config parses with the library's classes as `mixed-precision`, one config
  group per format, each targeting exactly the modules the recipe gives that format.
- eprt-check passes each mixed export.
"""

from fnmatch import fnmatchcase

import pytest
import yaml

from eprt.hf.check_export import check_export
from eprt.hf.export import export_hf
from eprt.quant.formats import weight_format
from tests.formats_helpers import quant_config, tiny_checkpoint
from tests.hf_utils import raw, read_hf_tensors

WIDE = dict(
    hidden_size=128,
    intermediate_size=256,
    moe_intermediate_size=128,
    q_lora_rank=128,
    kv_lora_rank=128,
    v_head_dim=32,
)
# (pattern, format) in rule order, then everything else unquantized: every data-free format twice over
MIXES = {
    "hopper": [
        ("*.experts", "int4_g32"),
        ("*.self_attn.*", "fp8_block"),
        ("*.shared_experts.*", "nvfp4_a16"),
        ("*.mlp.*", "fp8_channel"),
    ],
    "mx": [
        ("*.experts", "mxfp4"),
        ("*.self_attn.*", "mxfp8"),
        ("*.shared_experts.*", "w4a8"),
        ("*.mlp.*", "int4"),
    ],
}


def mix_recipe(path, name: str) -> str:
    rules = [{"pattern": p, "format": f} for p, f in MIXES[name]] + [{"pattern": "*", "format": "none"}]
    path.write_text(yaml.safe_dump({"name": name, "quantize": rules}))
    return str(path)


@pytest.fixture(scope="module")
def exports(tmp_path_factory):
    """(source dir, {mix or format: its data-free compressed-tensors export}) of one tiny DeepSeek-V3:
    every mix, and every format of them alone (compressed-tensors' layout, which every format here has)."""
    d = tmp_path_factory.mktemp("mixed")
    hf, ck = tiny_checkpoint(d, "deepseek_v3", **WIDE)
    recipes = {mix: mix_recipe(d / f"{mix}.yaml", mix) for mix in MIXES}
    recipes.update({f: f for rules in MIXES.values() for _, f in rules})
    return hf, {
        name: export_hf(ck, str(d / name), progress=False, fmt="compressed-tensors", recipe=recipe)
        for name, recipe in recipes.items()
    }


def quantized(tensors: dict) -> set[str]:
    """The modules of an export whose weight is quantized: those with a weight_scale."""
    return {n[: -len(".weight_scale")] for n in tensors if n.endswith(".weight_scale")}


def format_of(mix: str, module: str) -> str:
    """The format the mix's rules give a Hugging Face module (a routed expert's projections are
    named under the eprt module `...experts` the rule matches)."""
    return next(f for p, f in MIXES[mix] if fnmatchcase(module, p) or fnmatchcase(module, p + ".*"))


@pytest.mark.parametrize("mix", MIXES)
def test_each_module_holds_what_its_format_alone_writes(exports, mix):
    hf, out = exports
    assert check_export(out[mix], hf) == []
    ours, source = read_hf_tensors(out[mix]), read_hf_tensors(hf)
    claimed = set()
    for _, fmt in MIXES[mix]:
        alone = read_hf_tensors(out[fmt])
        mine = {m for m in quantized(ours) if format_of(mix, m) == fmt}
        assert mine and mine <= quantized(alone), (mix, fmt)
        for module in mine:
            leaves = {n for n in alone if n.startswith(module + ".")}
            assert leaves == {n for n in ours if n.startswith(module + ".")}, module
            for n in leaves:
                assert ours[n].dtype == alone[n].dtype and raw(ours[n]) == raw(alone[n]), n
            claimed |= leaves
    # the rest: the source's tensors, byte for byte, and nothing else
    rest = set(ours) - claimed
    assert rest <= set(source)
    for n in rest:
        assert raw(ours[n]) == raw(source[n]), n


@pytest.mark.parametrize("mix", MIXES)
def test_the_config_has_one_group_per_format_targeting_its_modules(exports, mix):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name

    mixed = exports[1][mix]
    parsed = QuantizationConfig.model_validate(quant_config(mixed, "config.json"))
    assert parsed.format == "mixed-precision"
    assert len(parsed.config_groups) == len(MIXES[mix])
    modules = quantized(read_hf_tensors(mixed))
    formats = set()
    for group in parsed.config_groups.values():
        targeted = {m for m in modules if any(match_name(m, t) for t in group.targets)}
        # a routed expert's projections are targeted one by one, or by a pattern over them
        (fmt,) = {format_of(mix, m) for m in targeted}
        assert targeted == {m for m in modules if format_of(mix, m) == fmt}, fmt
        assert group.format == weight_format(fmt).ct_format, fmt
        formats.add(fmt)
    assert formats == {f for _, f in MIXES[mix]}
