"""The format search (--auto-quantize): the choice meets its budget, counted here from the written
recipe and the model's shapes alone; a larger budget never gives a larger estimated loss; a group
made sensitive gets the more precise format; a budget no choice meets is refused naming the least
one; the written recipe reproduces the calibrated checkpoint (the search's own statistics kept,
the FP8 KV cache's among them) and the export; under GPTQ the search measures with max and the
written recipe with --algorithm gptq reproduces the export; the errors come from the calibration
sequences, not the held-out ones; and two ranks choose and export the same bytes."""

import filecmp
import json
import math
import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from eprt.errors import EprtError
from eprt.families import parse_hf_config, reader_for
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.algorithms.search.auto_quantize import SearchSpace
from eprt.quant.recipe import load_recipe
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.multiproc import run_world

# the last layer's attention output, its weights scaled up: its output outweighs the rest of the
# layer's, so its quantization error is the layer's
SENSITIVE = "model.layers.2.self_attn.o_proj"
SCALE = 64
DATA = {"calib_size": 4, "seq_len": 16, "eval_size": 2, "progress": False}
REPORT = "eprt_quality.json"
# bits per element as the export stores the weight, and per Linear its per-tensor fp32 scales
# (weight and input)
ELEMENT_BITS = {"nvfp4": 4 + 8 / 16, "fp8": 8, "none": 16}
LINEAR_BITS = {"nvfp4": 2 * 32, "fp8": 2 * 32, "none": 0}


def effective_bits(hf: str, format_of) -> float:
    """Bits per active parameter of the model at `hf` with each module in `format_of(module)`:
    a routed expert's Linears (gate, up, down) weigh top-k / E."""
    config = parse_hf_config(json.loads(Path(hf, "config.json").read_text()))
    layout = reader_for(config.model_type, hf).layout(config)
    bits = params = 0.0
    for m, spec in layout.linear_modules().items():
        fmt = format_of(m) or "none"
        if spec.stacked:
            E, two_i, D = spec.shape
            linears, weight = E * [(two_i // 2, D), (two_i // 2, D), (D, two_i // 2)], config.num_experts_per_tok / E
        else:
            linears, weight = [spec.shape], 1.0
        for out_dim, in_dim in linears:
            params += weight * out_dim * in_dim
            bits += weight * (out_dim * in_dim * ELEMENT_BITS[fmt] + LINEAR_BITS[fmt])
    return bits / params


@pytest.fixture(scope="module")
def searched(tmp_path_factory):
    """(source, checkpoint, budget, calibrated output, its export): a tiny model with SENSITIVE scaled,
    searched at a budget that buys one group of its size FP8 in place of NVFP4, and no more, with
    an FP8 KV cache."""
    d = tmp_path_factory.mktemp("auto_quantize")
    hf = make_tiny("qwen3_moe", str(d / "hf"))
    weights = load_file(os.path.join(hf, "model.safetensors"))
    weights[f"{SENSITIVE}.weight"] = weights[f"{SENSITIVE}.weight"] * SCALE
    save_file(weights, os.path.join(hf, "model.safetensors"), metadata={"format": "pt"})
    ck = convert_hf(hf, str(d / "ck"), progress=False)
    least = effective_bits(hf, lambda m: "nvfp4")
    budget = least + 1.5 * (effective_bits(hf, lambda m: "fp8" if m == SENSITIVE else "nvfp4") - least)
    out = str(d / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, None, out, auto_quantize=budget, kv_cache="fp8", **DATA))
    return hf, ck, budget, out, export_hf(out, str(d / "export"), progress=False)


def test_the_choice_meets_the_budget_and_keeps_the_sensitive_group_precise(searched):
    hf, _, budget, out, export = searched
    recipe = load_recipe(os.path.join(out, "auto_recipe.yaml"))
    assert effective_bits(hf, recipe.format_of) <= budget * (1 + 1e-12)
    assert recipe.format_of(SENSITIVE) in ("fp8", None)
    assert recipe.formats == ["fp8", "nvfp4"] and recipe.rules[-1].pattern == "*"
    report = json.loads(Path(export, REPORT).read_text())
    search = report["auto_quantize"]
    chosen = {m: recipe.format_of(m) or "none" for m in recipe_modules(recipe)}
    assert {e["group"]: e["format"] for e in search["map"]}[SENSITIVE] == chosen[SENSITIVE]
    assert search["effective_bits"] == pytest.approx(effective_bits(hf, recipe.format_of), rel=1e-12)
    assert search["measured_kl"] == report["kl_mean"] and search["estimated_kl"] > 0
    assert f"chosen by --auto-quantize {budget:.4g} bits" in Path(export, "eprt_quality.html").read_text()


def recipe_modules(recipe) -> list[str]:
    return [r.pattern for r in recipe.rules if r.pattern != "*"]


def test_a_larger_budget_never_gives_a_larger_estimated_loss(searched):
    hf, _, _, _, export = searched
    search = json.loads(Path(export, REPORT).read_text())["auto_quantize"]
    errors = {(e["group"], c): v for e in search["map"] for c, v in e["errors"].items()}
    config = parse_hf_config(json.loads(Path(hf, "config.json").read_text()))
    layout = reader_for(config.model_type, hf).layout(config)
    space = SearchSpace.of(layout, ("nvfp4", "fp8", "none"), config.num_experts_per_tok, config.num_experts)
    least = effective_bits(hf, lambda m: "nvfp4")
    # a sweep, and just short of each single group's FP8: where a choice's bits rounded down would overspend
    short = [effective_bits(hf, lambda m, g=g: "fp8" if m in g.modules else "nvfp4") - 1e-9 for g in space.groups]
    losses = []
    for budget in sorted([*torch.linspace(least, 16, 12, dtype=torch.float64).tolist(), *short]):
        choice = space.choose(budget, errors)
        groups = {m: choice[g.name] for g in space.groups for m in g.modules}
        assert effective_bits(hf, groups.get) <= budget * (1 + 1e-12)
        losses.append(space.loss(choice, errors))
    assert losses == sorted(losses, reverse=True) and losses[0] > 100 * losses[-1]


@pytest.mark.parametrize(
    "change, refusal",
    [
        ({"auto_quantize": 3.0}, "no choice of nvfp4,fp8,none meets it; the smallest feasible budget is {least}bits"),
        ({"eval_size": 0}, "the search fits its KL estimate on the quality report's held-out sequences"),
        ({"recipe": "nvfp4"}, "the search writes the recipe"),
        ({"auto_quantize": 16.0}, "leaves every module unquantized: nothing to export"),
    ],
)
def test_what_the_search_cannot_do_is_refused_by_name(searched, tmp_path, change, refusal):
    hf, ck, budget, _, _ = searched
    least = f"{math.ceil(effective_bits(hf, lambda m: 'nvfp4') * 1000) / 1000:.3f}"
    args = {**DATA, "auto_quantize": budget, **change}
    with pytest.raises(EprtError, match=refusal.format(least=least).replace(".", r"\.")):
        run_ptq(ParallelState.single(), PTQArgs(ck, args.pop("recipe", None), str(tmp_path / "q"), **args))
    assert not (tmp_path / "q").exists()


def same_files(a: str, b: str, but: tuple[str, ...] = (), only_in_a: tuple[str, ...] = ()) -> None:
    names = sorted(os.listdir(a))
    assert [n for n in names if n not in only_in_a] == sorted(os.listdir(b))
    for n in names:
        if n not in but + only_in_a:
            assert filecmp.cmp(os.path.join(a, n), os.path.join(b, n), shallow=False), n


def same_but_the_search(searched: str, reused: str, report: str, page: str) -> None:
    """Outputs of a search and of its written recipe: the same files, byte for byte, but the
    search's recipe and the report, which differs by the search's own field alone."""
    same_files(searched, reused, but=(report, page), only_in_a=("auto_recipe.yaml",))
    ours, theirs = (json.loads(Path(d, report).read_text()) for d in (searched, reused))
    del ours["auto_quantize"]
    assert ours == theirs


def test_the_written_recipe_reproduces_the_calibration_and_the_export(searched):
    """The search calibrates once: the statistics its pass measured are the chosen recipe's, the
    KV cache's with them, and its output is what the written recipe calibrates from scratch."""
    _, ck, _, out, export = searched
    again = str(Path(out).parent / "reused")  # beside `out`: the base's relative path the same
    run_ptq(ParallelState.single(), PTQArgs(ck, os.path.join(out, "auto_recipe.yaml"), again, **DATA))
    assert load_recipe(os.path.join(out, "auto_recipe.yaml")).kv_cache == "fp8"
    same_but_the_search(out, again, "quality.json", "quality.html")
    reused = export_hf(again, str(Path(out).parent / "reused-export"), progress=False)
    same_but_the_search(export, reused, REPORT, "eprt_quality.html")
    search = json.loads(Path(export, REPORT).read_text())["auto_quantize"]
    assert search["algorithms"] == {"search": "max", "calibration": "max"}


def test_gptq_searches_with_max_and_calibrates_the_choice_with_gptq(searched, tmp_path):
    """--algorithm gptq: the same errors and choice as the max search (its statistics), then the
    choice rounded by GPTQ, the bytes of the written recipe run with --algorithm gptq."""
    _, ck, budget, _, export = searched
    args = {**DATA, "kv_cache": "fp8", "algorithm": "gptq"}
    out = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, None, out, auto_quantize=budget, **args))
    again = str(tmp_path / "reused")
    run_ptq(ParallelState.single(), PTQArgs(ck, os.path.join(out, "auto_recipe.yaml"), again, **args))
    exported = export_hf(out, str(tmp_path / "export"), progress=False)
    same_but_the_search(exported, export_hf(again, str(tmp_path / "e"), progress=False), REPORT, "eprt_quality.html")
    ours, by_max = (json.loads(Path(e, REPORT).read_text()) for e in (exported, export))
    assert ours["auto_quantize"]["algorithms"] == {"search": "max", "calibration": "gptq"}
    assert ours["auto_quantize"]["map"] == by_max["auto_quantize"]["map"]
    assert ours["calibration"]["algorithm"] == "gptq"
    # GPTQ's codes, where max rounds the same weights: another export
    weights = "model-00001-of-00001.safetensors"
    assert not filecmp.cmp(Path(exported, weights), Path(export, weights), shallow=False)


def test_a_rotating_search_measures_the_rotated_model(searched, tmp_path):
    """--algorithm rotate: the search measures its errors and statistics on the rotated model, and its
    calibration keeps them: the written recipe, calibrated with rotate from scratch, exports the same bytes."""
    _, ck, budget, _, _ = searched
    args = {**DATA, "kv_cache": "fp8", "algorithm": "rotate"}
    out = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, None, out, auto_quantize=budget, **args))
    again = str(tmp_path / "reused")
    run_ptq(ParallelState.single(), PTQArgs(ck, os.path.join(out, "auto_recipe.yaml"), again, **args))
    exported = export_hf(out, str(tmp_path / "export"), progress=False)
    same_but_the_search(exported, export_hf(again, str(tmp_path / "e"), progress=False), REPORT, "eprt_quality.html")
    ours = json.loads(Path(exported, REPORT).read_text())
    assert ours["auto_quantize"]["algorithms"] == {"search": "rotate", "calibration": "rotate"}


def _search_at_ep_2(ck: str, out: str, budget: float) -> None:
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, PTQArgs(ck, None, out, auto_quantize=budget, kv_cache="fp8", batch_size=2, **DATA))


def test_two_ranks_choose_and_export_the_same_bytes(searched, tmp_path):
    _, ck, budget, out, export = searched
    run_world(_search_at_ep_2, 2, ck, str(tmp_path / "q"), budget, timeout=300)
    assert filecmp.cmp(os.path.join(out, "auto_recipe.yaml"), tmp_path / "q" / "auto_recipe.yaml", shallow=False)
    same_files(export, export_hf(str(tmp_path / "q"), str(tmp_path / "export"), progress=False))


def test_the_errors_are_measured_apart_from_the_held_out_sequences(searched, tmp_path):
    """Other held-out text changes the report's KL and the estimate's constant fitted on it, not the
    errors the choice is made from: they come from the calibration sequences."""
    _, ck, budget, _, export = searched
    other = tmp_path / "other.txt"
    other.write_text(" ".join(f"line {i} of other held-out text, not the calibration's." for i in range(200)))
    args = PTQArgs(ck, None, str(tmp_path / "q"), auto_quantize=budget, eval=str(other), **DATA)
    theirs = run_ptq(ParallelState.single(), args)["quality"]["auto_quantize"]
    ours = json.loads(Path(export, REPORT).read_text())["auto_quantize"]
    assert ours["map"] == theirs["map"]
    assert ours["measured_kl"] != theirs["measured_kl"] and ours["kl_per_error"] != theirs["kl_per_error"]


def test_mla_kv_b_proj_is_never_offered_a_format_that_quantizes_its_inputs_to_4_bits(tmp_path):
    """vLLM absorbs MLA's kv_b_proj through an identity matrix, which 4-bit inputs would quantize
    (eprt.quant.absorbed): the search offers it every other candidate, and every other group NVFP4."""
    hf = make_tiny("deepseek_v3", str(tmp_path / "hf"))
    config = parse_hf_config(json.loads(Path(hf, "config.json").read_text()))
    layout = reader_for(config.model_type, hf).layout(config)
    candidates = ("nvfp4", "nvfp4_a16", "fp8", "none")
    space = SearchSpace.of(layout, candidates, config.num_experts_per_tok, config.num_experts)
    absorbed = [g.name for g in space.groups if g.modules[0].endswith(".self_attn.kv_b_proj")]
    assert len(absorbed) == config.num_layers
    assert {g.name: sorted(g.bits) for g in space.groups} == {
        g.name: sorted(set(candidates) - ({"nvfp4"} if g.name in absorbed else set())) for g in space.groups
    }
    with pytest.raises(EprtError, match=r"fits model\.layers\.0\.self_attn\.kv_b_proj .*identity matrix"):
        SearchSpace.of(layout, ("nvfp4",), config.num_experts_per_tok, config.num_experts)
