"""The model-free export of routed experts stored fused and transposed ([E, in, out]: transformers'
GPT-OSS in bf16, with gate and up interleaved, and Llama-4, concatenated).

- A family eprt models reads the order from its own table: its model-free export is its modeled
  data-free export byte for byte (tests/test_model_free.py holds every data-free recipe on GPT-OSS,
  Llama-4 and Llama-4's text model); here also checkpoints transformers' save_pretrained wrote, a
  recipe that leaves the experts unquantized, which writes them expert by expert in bf16, and a
  recipe's experts_storage, which such a family refuses. The memory plan counts each expert's read.
- A checkpoint eprt does not model (OLMoE, a transformers model made here) stored with its experts
  fused and transposed gives the tensors of the same checkpoint stored per expert, byte for byte:
  each expert's Linear is quantized [out, in], its blocks along its inputs. A layer's stacks share
  one order, which their shapes tell against hidden_size together (OLMoE's square down_proj takes
  its gate_up_proj's); gate and up interleaved are read apart where the recipe says so.
- Where every stack of a layer is square the shapes cannot tell the order: refused by name, and
  the recipe's experts_storage says it.
- GPT-OSS under a model_type eprt does not model, its interleaving said by the recipe: the tensors of
  the modeled export, biases expert by expert beside the weights.
"""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from eprt.errors import ConfigError
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.hf.streaming import stream_export
from eprt.testing.tiny import make_tiny
from tests.hf_utils import raw, read_hf_tensors
from tests.test_model_free import LAYERS, E, layout_of, make_olmoe, same_files

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def olmoe(tmp_path_factory):
    return make_olmoe(str(tmp_path_factory.mktemp("olmoe") / "hf"))


@pytest.fixture(scope="module")
def per_expert(olmoe, tmp_path_factory):
    cache = {}

    def of(recipe: str) -> dict[str, torch.Tensor]:
        if recipe not in cache:
            out = str(tmp_path_factory.mktemp("per_expert") / "out")
            cache[recipe] = read_hf_tensors(stream_export(olmoe, out, recipe, fmt=layout_of(recipe), progress=False))
        return cache[recipe]

    return of


def restacked(olmoe: str, out, transposed: bool, interleaved: bool = False, fused: bool = True) -> str:
    """OLMoE with each layer's experts stacked: gate_up_proj (or gate_proj and up_proj apart) and down_proj,
    [E, out, in] or `transposed` [E, in, out], gate and up of gate_up_proj `interleaved` or gate then up."""
    shutil.copytree(olmoe, out, ignore=shutil.ignore_patterns("*.safetensors"))
    t = read_hf_tensors(olmoe)
    for i in range(LAYERS):
        p = f"model.layers.{i}.mlp.experts"
        stacks = {k: torch.stack([t.pop(f"{p}.{e}.{k}.weight") for e in range(E)]) for k in ("gate_proj", "up_proj")}
        stacks["down_proj"] = torch.stack([t.pop(f"{p}.{e}.down_proj.weight") for e in range(E)])
        if fused:
            gate, up = stacks.pop("gate_proj"), stacks.pop("up_proj")
            both = torch.stack([gate, up], 2).flatten(1, 2) if interleaved else torch.cat([gate, up], 1)
            stacks["gate_up_proj"] = both
        for k, w in stacks.items():
            t[f"{p}.{k}"] = w.transpose(1, 2).contiguous() if transposed else w
    save_file(t, str(out / "model.safetensors"))
    return str(out)


def recipe_with(tmp_path, recipe: str, **storage) -> str:
    """Shipped `recipe`'s rules with experts_storage `storage`."""
    from eprt.quant.recipe import load_recipe

    path = tmp_path / f"{recipe}_storage.yaml"
    rules = [{"pattern": r.pattern, "format": r.format} for r in load_recipe(recipe).rules]
    path.write_text(json.dumps({"name": path.stem, "quantize": rules, "experts_storage": storage}))
    return str(path)


def assert_same_tensors(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, t in want.items():
        assert got[name].dtype == t.dtype and raw(got[name]) == raw(t), name


@pytest.mark.parametrize("recipe", ["fp8_block", "nvfp4_a16", "int4_g32", "mxfp4"])
def test_transposed_stacks_give_the_tensors_of_the_per_expert_checkpoint(olmoe, per_expert, recipe, tmp_path):
    """Blocks and groups along each expert's inputs: the bytes of the per-expert source's export, where
    every expert's Linear is [out, in] by name (gate_up_proj [E, 128, 256] tells the layer's order;
    down_proj [E, 128, 128] alone could not)."""
    hf = restacked(olmoe, tmp_path / "hf", transposed=True)
    got = read_hf_tensors(stream_export(hf, str(tmp_path / "out"), recipe, fmt=layout_of(recipe), progress=False))
    assert_same_tensors(got, per_expert(recipe))


def test_interleaved_gate_and_up_are_read_apart_as_the_recipe_says(olmoe, per_expert, tmp_path):
    hf = restacked(olmoe, tmp_path / "hf", transposed=True, interleaved=True)
    recipe = recipe_with(tmp_path, "nvfp4_a16", interleaved=True)
    got = read_hf_tensors(stream_export(hf, str(tmp_path / "out"), recipe, progress=False))
    assert_same_tensors(got, per_expert("nvfp4_a16"))
    # read as concatenated (the default), the experts' gate and up would be other rows: other bytes
    other = read_hf_tensors(stream_export(hf, str(tmp_path / "other"), "nvfp4_a16", progress=False))
    name = "model.layers.0.mlp.experts.0.gate_proj.weight"
    assert raw(other[name]) != raw(got[name])


def test_square_stacks_are_refused_by_name_and_the_recipe_says_their_order(olmoe, per_expert, tmp_path):
    """gate_proj, up_proj and down_proj stacked apart, each [E, 128, 128] (OLMoE's hidden and expert
    widths are equal): no shape tells [E, out, in] from [E, in, out]."""
    hf = restacked(olmoe, tmp_path / "hf", transposed=True, fused=False)
    square = r"the stacks of model\.layers\.0\.mlp\.experts \(.*experts\.gate_proj \[8, 128, 128\]"
    with pytest.raises(ConfigError, match=square + r".*are square.*experts_storage: \{transposed: true\}"):
        stream_export(hf, str(tmp_path / "out"), "fp8_block", progress=False)
    assert not (tmp_path / "out").exists()
    told = stream_export(
        hf, str(tmp_path / "told"), recipe_with(tmp_path, "fp8_block", transposed=True), progress=False
    )
    assert_same_tensors(read_hf_tensors(told), per_expert("fp8_block"))
    # an order the shapes rule out is refused, naming what the recipe said
    with pytest.raises(
        ConfigError, match=r"mlp\.experts\.gate_up_proj \[8, 128, 256\].*as the recipe's experts_storage"
    ):
        wrong = recipe_with(tmp_path, "fp8_block", transposed=False)
        stream_export(restacked(olmoe, tmp_path / "fused", True), str(tmp_path / "x"), wrong, progress=False)


def test_a_recipes_experts_storage_is_refused_for_a_family_eprt_models(tmp_path):
    hf = make_tiny("gpt_oss", str(tmp_path / "hf"))
    with pytest.raises(ConfigError, match="experts_storage, which is for a checkpoint eprt does not model"):
        stream_export(hf, str(tmp_path / "out"), recipe_with(tmp_path, "fp8_block", interleaved=True), progress=False)


def test_an_unmodeled_gpt_oss_gives_the_modeled_exports_tensors(tmp_path):
    """GPT-OSS in bf16 as transformers saves it, under a model_type eprt does not model: by name
    patterns, its interleaving said by the recipe, the tensors of its family's export (the
    router, sinks and norms alone; each expert's biases beside its weights)."""
    hf = make_tiny("gpt_oss", str(tmp_path / "hf"))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    unknown = tmp_path / "unknown"
    shutil.copytree(hf, unknown)
    config = json.loads((unknown / "config.json").read_text())
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "not_modeled_moe"}))
    for recipe in ("nvfp4_a16", "nvfp4_experts_only_input_scale1"):
        want = read_hf_tensors(export_hf(ck, str(tmp_path / f"m-{recipe}"), recipe=recipe, progress=False))
        told = recipe_with(tmp_path, recipe, interleaved=True)
        got = read_hf_tensors(stream_export(str(unknown), str(tmp_path / f"s-{recipe}"), told, progress=False))
        assert_same_tensors(got, want)
        assert "model.layers.1.mlp.experts.7.up_proj.bias" in got


@pytest.mark.parametrize("family", ["gpt_oss", "llama4"])
def test_unquantized_transposed_experts_are_the_modeled_exports(family, tmp_path):
    """A recipe that leaves the experts alone: the modeled export writes them expert by expert, [out, in]."""
    hf = make_tiny(family, str(tmp_path / "hf"))
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    recipe = tmp_path / "no_experts.yaml"
    recipe.write_text(
        "name: no_experts\nquantize:\n  - {pattern: '*.experts', format: none}\n  - {pattern: '*', format: fp8_channel}\n"
    )
    modeled = export_hf(ck, str(tmp_path / "m"), recipe=str(recipe), progress=False)
    assert same_files(modeled, stream_export(hf, str(tmp_path / "s"), str(recipe), progress=False))


@pytest.mark.parametrize("storage", [{"transposed": "yes"}, {"order": "transposed"}, {}, "transposed"])
def test_a_malformed_experts_storage_is_refused_by_name(storage):
    from eprt.quant.recipe import parse_recipe

    with pytest.raises(ConfigError, match=r"r\.yaml: experts_storage .*write a mapping of transposed: true\|false"):
        parse_recipe({"quantize": [{"pattern": "*", "format": "fp8_block"}], "experts_storage": storage}, "r.yaml")


def test_experts_storage_reads_back_from_the_recipes_json():
    from eprt.quant.recipe import parse_recipe

    recipe = parse_recipe(
        {"quantize": [{"pattern": "*", "format": "fp8_block"}], "experts_storage": {"interleaved": True}}, "r"
    )
    assert recipe.to_json()["experts_storage"] == {"interleaved": True}
    assert parse_recipe(recipe.to_json(), "r") == recipe


def test_the_memory_plan_counts_an_experts_entry_and_its_copy_in_eprts_order(olmoe, tmp_path):
    """A transposed stack's expert is read whole (gate and up) and copied into [out, in]: the plan's
    largest piece holds both, beyond what the same Linear read per expert holds."""
    from eprt.hf.streaming.memory import plan_memory
    from eprt.hf.streaming.run import Settings, Stream

    def largest(hf: str) -> int:
        stream = Stream(Settings(hf, "fp8_block", None, "modelopt", 1 << 30))
        try:
            return plan_memory(stream, 1, process=0).largest
        finally:
            stream.src.close()

    entry = 2 * 128 * 2 * 128  # bf16 gate_up_proj entry [128, 256]
    hf = restacked(olmoe, tmp_path / "hf", transposed=True)
    assert largest(hf) - largest(olmoe) == 2 * entry


def saved_by_transformers(family: str, out: str) -> str:
    """`family`'s tiny config as transformers builds and saves the model (bf16, random weights)."""
    from eprt.testing.tiny import tiny_config

    classes = {"gpt_oss": transformers.GptOssForCausalLM, "llama4_text": transformers.Llama4ForCausalLM}
    cls = classes[family]
    torch.manual_seed(0)
    cls(cls.config_class.from_dict(tiny_config(family))).to(torch.bfloat16).save_pretrained(out)
    return out


@pytest.mark.parametrize("family", ["gpt_oss", "llama4_text"])
def test_transformers_save_pretrained_exports_as_its_conversion(family, tmp_path):
    """GPT-OSS in bf16 and Llama-4 as transformers' save_pretrained writes them (experts fused and
    transposed): the model-free export is the export of the converted checkpoint, every file."""
    hf = saved_by_transformers(family, str(tmp_path / "hf"))
    block = {"gpt_oss": "mlp", "llama4_text": "feed_forward"}[family]
    assert read_hf_tensors(hf)[f"model.layers.1.{block}.experts.gate_up_proj"].shape == (8, 64, 64)  # [E, D, 2I]
    ck = convert_hf(hf, str(tmp_path / "ck"), progress=False)
    for recipe in ("nvfp4_a16", "fp8_block"):
        modeled = export_hf(ck, str(tmp_path / f"m-{recipe}"), recipe=recipe, progress=False)
        assert same_files(modeled, stream_export(hf, str(tmp_path / f"s-{recipe}"), recipe, progress=False)), recipe


def test_eprt_check_holds_stacked_experts_against_the_source_either_way(olmoe, tmp_path):
    """With --source, an export of stacks of experts (either order, their biases too) passes: each stack
    written expert by expert where quantized, whole where not; an expert the export lacks is named."""
    from safetensors.torch import load_file

    from eprt.hf.check_export import check_export

    for transposed in (False, True):
        hf = restacked(olmoe, tmp_path / f"hf-{transposed}", transposed=transposed)
        out = stream_export(hf, str(tmp_path / f"out-{transposed}"), "nvfp4_a16", progress=False)
        assert check_export(out, hf) == [], transposed
    whole = tmp_path / "no_experts.yaml"
    whole.write_text(
        "name: no_experts\nquantize:\n  - {pattern: '*', format: fp8_channel}\nignore: ['*.experts', '*.gate', '*norm*', '*embed*', lm_head]\n"
    )
    out = stream_export(hf, str(tmp_path / "whole"), str(whole), progress=False)
    assert "model.layers.0.mlp.experts.gate_up_proj" in read_hf_tensors(out) and check_export(out, hf) == []
    gpt_oss = make_tiny("gpt_oss", str(tmp_path / "gpt_oss"))
    config = json.loads((tmp_path / "gpt_oss" / "config.json").read_text())
    (tmp_path / "gpt_oss" / "config.json").write_text(json.dumps({**config, "model_type": "not_modeled_moe"}))
    told = recipe_with(tmp_path, "nvfp4_a16", interleaved=True)
    assert check_export(stream_export(gpt_oss, str(tmp_path / "biased"), told, progress=False), gpt_oss) == []
    # one expert's down projection gone
    broken = tmp_path / "broken"
    shutil.copytree(str(tmp_path / "out-True"), broken)
    shard = next(broken.glob("*.safetensors"))
    tensors = {
        n: t for n, t in load_file(str(shard)).items() if ".experts.3.down_proj." not in n or ".layers.1." not in n
    }
    save_file(tensors, str(shard), metadata={"format": "pt"})
    index = json.loads((broken / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: f for n, f in index["weight_map"].items() if n in tensors}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    problems = check_export(str(broken), hf)
    assert "model.layers.1.mlp.experts.down_proj: a source tensor missing from the export" in problems, problems
