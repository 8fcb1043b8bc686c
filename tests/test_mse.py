"""`--algorithm max|mse` and a recipe rule's `algorithm`: how weight scales are chosen, recorded
in the calibrated checkpoint, refused by name when unknown; the mse search never above max's
error and below it somewhere, the same bytes at every layout and in both export layouts, and
the preview's weights the export's."""

import json
import os
import re
import subprocess
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch

import eprt
from eprt.errors import ConfigError
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.algorithms.registry import rotated
from eprt.quant.calibrated import CalibrationRecord
from eprt.quant.formats.fp8 import dequantize_fp8, fp8_mse_scale, fp8_scale
from eprt.quant.formats.nvfp4 import dequantize_nvfp4
from eprt.quant.preview import fake_quantize
from eprt.quant.recipe import ALGORITHMS, load_recipe, parse_recipe
from eprt.quant.run.ptq import PTQArgs, fingerprint, run_ptq
from eprt.quant.run.setup import plan_recipe
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.hf_utils import raw, read_hf_tensors
from tests.layouts.test_ptq import same_files
from tests.multiproc import free_port, run_world
from tests.oracles.test_compressed_tensors_export import expected_from_modelopt

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen")
    hf = make_tiny("qwen3_moe", str(d / "hf"))
    return hf, convert_hf(hf, str(d / "ck"), progress=False)


@pytest.fixture(scope="module")
def qwen(source):
    return source[1]


# Both formats on both kinds of weight: layer 0's experts and attention in FP8, the rest (layer 2's
# experts, layer 1's dense MLP, fused q/k/v) in NVFP4.
BY_LAYER = (
    "name: by_layer\nquantize:\n  - {pattern: 'model.layers.0.*', format: fp8}\n  - {pattern: '*', format: nvfp4}\n"
)
CALIB = {"calib_size": 4, "seq_len": 8, "progress": False}


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    path = tmp_path_factory.mktemp("recipe") / "by_layer.yaml"
    path.write_text(BY_LAYER)
    return str(path)


@pytest.fixture(scope="module")
def exports(qwen, recipe, tmp_path_factory):
    """{algorithm: (calibrated checkpoint, its export)} of the tiny model under the by-layer recipe."""
    d = tmp_path_factory.mktemp("exports")
    out = {}
    for a in (a for a in ALGORITHMS if not rotated(a)):
        q = str(d / a)
        run_ptq(ParallelState.single(), PTQArgs(qwen, recipe, q, batch_size=2, algorithm=a, **CALIB))
        out[a] = q, export_hf(q, q + "-hf", progress=False)
    return out


def weight_errors(export: str, src: dict[str, torch.Tensor]) -> dict[str, float]:
    """Squared quantization error of every quantized weight of `export` against the source weights,
    summed per scale holder: a dense Linear, a routed expert's gate and up together (they share
    one scale, as w13), its down."""
    t = read_hf_tensors(export)
    out: dict[str, float] = {}
    for name, w in t.items():
        module, _, leaf = name.rpartition(".")
        if leaf != "weight" or f"{module}.weight_scale" not in t:
            continue
        if w.dtype == torch.float8_e4m3fn:
            deq = w.double() * t[f"{module}.weight_scale"].double()
        else:
            deq = dequantize_nvfp4(w, t[f"{module}.weight_scale"], t[f"{module}.weight_scale_2"]).double()
        holder = re.sub(r"\.(gate|up)_proj$", ".w13", module) if ".experts." in module else module
        out[holder] = out.get(holder, 0.0) + (src[name].double() - deq).square().sum().item()
    return out


# --- the recipe's algorithm and the flag ---------------------------------------------------------


def test_a_rule_names_its_algorithm_and_the_others_take_the_default():
    d = {
        "name": "r",
        "quantize": [
            {"pattern": "*.experts", "format": "nvfp4", "algorithm": "mse"},
            {"pattern": "*.lm_head", "format": "none"},
            {"pattern": "*", "format": "fp8"},
        ],
    }
    r = parse_recipe(d, "r.yaml")
    assert r.algorithm_of("model.layers.1.mlp.experts") == "mse"
    assert r.algorithm_of("model.layers.1.self_attn.q_proj") == "max"  # the default
    assert r.algorithm_of("model.lm_head") is None  # not quantized
    assert r.algorithms == ["max", "mse"]
    assert parse_recipe(d, "r.yaml", algorithm="mse").algorithms == ["mse"]
    # what the calibrated checkpoint records reads back as the same recipe, whatever the default then
    assert parse_recipe(r.to_json(), "q", algorithm="mse") == r
    assert load_recipe("nvfp4", algorithm="mse").algorithm_of("model.layers.0.mlp.experts") == "mse"


@pytest.mark.parametrize(
    "d, algorithm, message",
    [
        (
            {"quantize": [{"pattern": "*", "format": "nvfp4", "algorithm": "smoothquant"}]},
            None,
            "r.yaml: quantize[0] algorithm 'smoothquant': unknown algorithm; choose one of max, mse, gptq, awq, awq+gptq, rotate, rotate+mse, "
            "rotate+gptq, rotate+awq, rotate+awq+gptq",
        ),
        (
            {"quantize": [{"pattern": "*", "format": "nvfp4"}]},
            "smoothquant",
            "--algorithm 'smoothquant': unknown algorithm; choose one of max, mse, gptq, awq, awq+gptq, rotate, rotate+mse, "
            "rotate+gptq, rotate+awq, rotate+awq+gptq",
        ),
    ],
)
def test_an_unknown_algorithm_is_refused_by_name_with_the_choices(d, algorithm, message):
    with pytest.raises(ConfigError) as e:
        parse_recipe(d, "r.yaml", algorithm=algorithm)
    assert str(e.value) == message


def test_the_flag_refuses_an_unknown_algorithm_with_the_choices(qwen):
    r = subprocess.run(
        [sys.executable, "tools/ptq.py", qwen, "--dry-run", "--recipe", "nvfp4", "--algorithm", "smoothquant"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2
    assert (
        "--algorithm: invalid choice: 'smoothquant' (choose from " + ", ".join(map(repr, ALGORITHMS)) + ")" in r.stderr
    )


def test_the_calibrated_checkpoint_records_the_algorithm(qwen, tmp_path):
    q = str(tmp_path / "q")
    run_ptq(
        ParallelState.single(),
        PTQArgs(qwen, "nvfp4_experts_fp8_attention", q, calib_size=2, seq_len=8, algorithm="mse", progress=False),
    )
    quant = json.load(open(os.path.join(q, "eprt.json")))["quantization"]
    assert quant["calibration"]["algorithm"] == "mse"
    assert {r["algorithm"] for r in quant["recipe"]["quantize"]} == {"mse"}


def test_a_run_resumes_only_from_a_run_with_its_own_algorithm(qwen):
    samples = torch.zeros(2, 8, dtype=torch.int64)
    with Checkpoint(qwen) as ck:
        prints = [
            fingerprint(ck, PTQArgs(qwen, "nvfp4", "q", algorithm=a), ParallelState.single(), samples, None)
            for a in ALGORITHMS
        ]
    assert len({json.dumps(p, sort_keys=True) for p in prints}) == len(ALGORITHMS)


# --- the mse search --------------------------------------------------------------------------------


def test_mse_error_is_at_most_max_error_on_every_weight_and_below_it_somewhere(source, exports):
    src = read_hf_tensors(source[0])
    by_max, by_mse = (weight_errors(exports[a][1], src) for a in ("max", "mse"))
    assert by_max.keys() == by_mse.keys()
    # float64 sums of the same squares in another order: equal up to the last bits
    worse = {h: (by_mse[h], by_max[h]) for h in by_max if by_mse[h] > by_max[h] * (1 + 1e-12)}
    assert worse == {}
    improved = {h for h in by_max if by_mse[h] < by_max[h] * (1 - 1e-9)}
    for layer, fmt in ((0, "fp8"), (2, "nvfp4")):  # routed experts (per expert) and dense Linears, each format
        mine = [h for h in by_max if h.startswith(f"model.layers.{layer}.")]
        assert any(".experts." in h for h in improved & set(mine)), fmt
        assert any(".experts." not in h for h in improved & set(mine)), fmt
        assert sum(by_mse[h] for h in mine) < sum(by_max[h] for h in mine), fmt
    assert check_export(exports["mse"][1], source[0]) == []


def _calibrate_mse(ck: str, recipe: str, out: str, port: int) -> None:
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, PTQArgs(ck, recipe, out, batch_size=1, algorithm="mse", **CALIB))


def test_mse_exports_are_the_same_bytes_at_every_layout_and_in_compressed_tensors(qwen, recipe, exports, tmp_path):
    q, one = exports["mse"]
    run_world(_calibrate_mse, 2, qwen, recipe, str(tmp_path / "w2-ep2"), free_port(), timeout=200)
    assert same_files(one, export_hf(str(tmp_path / "w2-ep2"), str(tmp_path / "w2-ep2-hf"), progress=False))
    # the compressed-tensors layout (checked as it is written) holds the same searched values
    ct = read_hf_tensors(export_hf(q, str(tmp_path / "ct"), progress=False, fmt="compressed-tensors"))
    want = expected_from_modelopt(read_hf_tensors(one))
    assert set(ct) == set(want)
    assert all(raw(ct[n]) == raw(want[n]) for n in want)


def test_fp8_mse_keeps_max_scale_where_it_quantizes_exactly():
    """Max's candidate is in the list: a weight that max's scale quantizes without error (every
    E4M3 value, both signs) keeps it, where every other multiplier would lose some value."""
    values = torch.arange(1, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    w = torch.cat([values, -values]).bfloat16().reshape(12, 21)
    amax = w.abs().amax().float()
    assert torch.equal(fp8_mse_scale(w, amax), fp8_scale(amax))
    assert torch.equal(fp8_mse_scale(w * 0.75, amax * 0.75), fp8_scale(amax * 0.75))  # 0.75: exact in bf16


def test_the_preview_fake_quantizes_with_the_exported_mse_scales(qwen, recipe, exports):
    """--preview's model holds, for every quantized weight, the export's dequantized mse weight."""
    q, out = exports["mse"]
    with Checkpoint(q) as ck:
        rec, targets = plan_recipe(ResolvedCheckpoint.of(ck, torch.float32), recipe, algorithm="mse")
        st = CalibrationRecord.read(ck)
    cal = SimpleNamespace(
        input_amax=st.input_amax, expert_amax=st.expert_input_amax, expert_tokens=st.expert_tokens, kv_amax=st.kv_amax
    )
    model = eprt.load_model(qwen, dtype=torch.bfloat16)
    fake_quantize(model, targets, rec, cal, ParallelState.single())
    t = read_hf_tensors(out)

    def exported(module: str) -> torch.Tensor:
        w = t[f"{module}.weight"]
        if w.dtype == torch.float8_e4m3fn:
            return dequantize_fp8(w, t[f"{module}.weight_scale"], dtype=torch.bfloat16)
        return dequantize_nvfp4(w, t[f"{module}.weight_scale"], t[f"{module}.weight_scale_2"], dtype=torch.bfloat16)

    checked = 0
    for m in targets:
        module = model.get_submodule(m)
        if m.endswith(".experts"):
            for e in range(module.w13.shape[0]):
                want = torch.cat([exported(f"{m}.{e}.gate_proj"), exported(f"{m}.{e}.up_proj")])
                assert torch.equal(module.w13[e], want) and torch.equal(module.w2[e], exported(f"{m}.{e}.down_proj"))
                checked += 1
        else:
            assert torch.equal(module.weight, exported(m)), m
            checked += 1
    assert checked > 20
