"""Activation headroom for NVFP4 input scales (a recipe's `act_headroom`): the amax is ModelOpt's
`nvfp4_act_headroom` calibrator's own, bit for bit, on the same inputs, both for a block of data
given at once and for every dense input and every routed expert's two inputs of a model
calibrated layer by layer; the export's input scales are those amax's; the recipe key reads,
writes back and refuses what it cannot mean."""

import json
import os
import warnings
from datetime import timedelta

import pytest
import torch

from eprt.errors import ConfigError
from eprt.families import reader_for
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.act_headroom import ActHeadroom, headroom_targets
from eprt.quant.formats.nvfp4 import nvfp4_scale
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.loop.passes import layer_passes
from eprt.quant.loop.sequences import Schedule
from eprt.quant.recipe import parse_recipe
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.ep_checks import same_files
from tests.hf_utils import read_hf_tensors
from tests.multiproc import free_port, run_world

calib = pytest.importorskip("modelopt.torch.quantization.calib.nvfp4_act_headroom")

RULES = [{"pattern": "*", "format": "nvfp4"}]
# (settings, octaves the blocks span, whether rho x anchor is well above the top of the range)
SETTINGS = [
    ({}, 8, True),  # ModelOpt's defaults
    ({"upper_percentile": 100.0}, 8, True),
    ({"anchor_percentile": 20.0, "rho": 8192.0}, 8, True),
    ({"rho": 2.0}, 8, False),  # the top of the range is the amax
    ({}, 24, False),  # a range wider than E4M3's: likewise
]


def theirs(batches: list[torch.Tensor], settings: dict) -> torch.Tensor:
    cal = calib.NVFP4ActHeadroomCalibrator(block_size=16, **settings)
    for x in batches:
        cal.collect(x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # where it falls back to the top of the range, it says so
        return cal.compute_amax()


def batches(octaves: int) -> list[torch.Tensor]:
    """bf16 inputs whose blocks span `octaves` octaves, one far above the rest, some all zero."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(3):
        exponents = torch.randint(-octaves, 1, (40, 8, 1), generator=g).float()
        x = torch.randn(40, 8, 16, generator=g) * torch.exp2(exponents)
        x[0, :2] = 0.0
        out.append(x.reshape(40, 128).bfloat16())
    out[1][5, 7] = 30.0
    return out


@pytest.mark.parametrize("settings,octaves,roomy", SETTINGS, ids=["defaults", "upper100", "anchor20", "rho2", "wide"])
def test_the_amax_is_modelopts(settings, octaves, roomy):
    xs = batches(octaves)
    mine = ActHeadroom(**settings)
    counts = sum(mine.histogram(x, 16) for x in xs)
    running_max = max(x.abs().amax().float() for x in xs)
    amax = mine.amax(counts, running_max)
    assert torch.equal(amax, theirs(xs, settings))
    assert (amax > 2 * running_max) == roomy  # a bin centre is within 11% of its values


class Capturing(Calibrator):
    """A calibrator that also keeps every input its headroom targets see (dense: per call; experts:
    each row with its expert)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seen: dict[str, list] = {}

    def _observe_input(self, name, module):
        super()._observe_input(name, module)
        hook = lambda _m, args: self.seen.setdefault(name, []).append(args[0].clone())  # noqa: E731
        self._taps.callback(module.register_forward_pre_hook(hook).remove)

    def _count_blocks(self, name, expert_of_row, count, x, h):
        self.seen.setdefault(name, []).append((expert_of_row.clone(), x.clone(), h.clone()))
        super()._count_blocks(name, expert_of_row, count, x, h)


@pytest.fixture(scope="module")
def qwen3_moe(tmp_path_factory):
    d = tmp_path_factory.mktemp("qwen3_moe")
    return convert_hf(make_tiny("qwen3_moe", str(d / "hf"), dtype="bf16"), str(d / "ck"), progress=False)


@pytest.mark.parametrize("all_experts", [False, True], ids=["routed", "all-experts"])
def test_every_input_of_a_calibrated_model_gets_modelopts_amax(qwen3_moe, all_experts):
    """With --calibrate-all-experts, an expert's histograms take every token's rows, as its amax does."""
    recipe = parse_recipe({"quantize": RULES, "act_headroom": {"anchor_percentile": 5, "rho": 256}}, "r")
    samples = torch.randint(0, 200, (4, 16), generator=torch.Generator().manual_seed(0))
    with Checkpoint(qwen3_moe) as ck, torch.inference_mode():
        targets = reader_for(ck.config.model_type, qwen3_moe).layout(ck.config).linear_modules()
        headroom = headroom_targets(recipe, targets)
        assert set(headroom) == set(targets) and targets
        cal = Capturing(None, targets, kv=False, all_experts=all_experts, headroom=headroom)
        rc = ResolvedCheckpoint.of(ck, torch.bfloat16)
        engine = LayerEngine(
            ParallelState.single("cpu"),
            rc,
            samples,
            layer_passes(cal),
            schedule=Schedule.of(4, 16, 1, group_tokens=16),
            progress=False,
        )
        engine.run(0, engine.embed())
    settings = recipe.act_headroom.to_json()
    experts = [m for m in targets if m in cal.expert_amax]
    assert experts and not cal.input_hist and not cal.expert_hist  # every layer's made final
    for m in targets:
        if m not in experts:
            assert torch.equal(cal.input_amax[m], theirs(cal.seen[m], settings)), m
            continue
        for e in range(cal.expert_amax[m][0].shape[0]):
            rows_of_e = sum(int((step[0] == e).sum()) for step in cal.seen[m])
            assert rows_of_e >= samples.numel() if all_experts else rows_of_e < samples.numel(), (m, e)
            for j, amax in enumerate(cal.expert_amax[m]):  # the expert's input, then its activation
                rows = [step[1 + j][step[0] == e] for step in cal.seen[m]]
                rows = [r for r in rows if r.shape[0]]
                want = theirs(rows, settings) if rows else torch.tensor(0.0)
                assert torch.equal(amax[e], want), (m, e, j)


CALIB = {"calib_size": 4, "seq_len": 16, "batch_size": 1, "progress": False}


def _calibrate(ck: str, recipe: str, out: str, port: int) -> None:
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, PTQArgs(ck, recipe, out, **CALIB))


def test_the_export_writes_the_headroom_input_scales_at_every_layout(qwen3_moe, tmp_path):
    """The export's input scales are the headroom amax's, they differ from max's, and two ranks
    (the dense histograms summed over them, the experts' held apart) write the same bytes."""

    def calibrated(recipe: dict, name: str) -> tuple[str, str]:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(recipe))
        q = str(tmp_path / name)
        run_ptq(ParallelState.single(), PTQArgs(qwen3_moe, str(path), q, **CALIB))
        return str(path), q

    recipe, roomy_q = calibrated({"quantize": RULES, "act_headroom": True}, "roomy")
    _, plain_q = calibrated({"quantize": RULES}, "plain")
    roomy_hf = export_hf(roomy_q, str(tmp_path / "roomy-hf"), progress=False)
    scales = lambda hf: {n: t for n, t in read_hf_tensors(hf).items() if n.endswith("input_scale")}  # noqa: E731
    roomy, plain = scales(roomy_hf), scales(export_hf(plain_q, str(tmp_path / "plain-hf"), progress=False))
    assert roomy.keys() == plain.keys() and roomy
    assert all(not torch.equal(roomy[n], plain[n]) for n in roomy)
    with Checkpoint(roomy_q) as ck:
        amax = ck.read("model.layers.0.self_attn.o_proj.input_amax")
    assert torch.equal(roomy["model.layers.0.self_attn.o_proj.input_scale"], nvfp4_scale(amax))

    run_world(_calibrate, 2, qwen3_moe, recipe, str(tmp_path / "w2-ep2"), free_port(), timeout=200)
    assert same_files(roomy_hf, export_hf(str(tmp_path / "w2-ep2"), str(tmp_path / "w2-ep2-hf"), progress=False))


def test_the_recipe_key_reads_writes_back_and_refuses():
    recipe = parse_recipe({"quantize": RULES, "act_headroom": True}, "r")
    assert recipe.act_headroom == ActHeadroom()
    assert parse_recipe(recipe.to_json(), "r") == recipe
    assert "act_headroom" not in parse_recipe({"quantize": RULES}, "r").to_json()  # as before when unset
    weight_only = parse_recipe({"quantize": [{"pattern": "*", "format": "nvfp4_a16"}], "act_headroom": True}, "r")
    assert headroom_targets(weight_only, ["model.layers.0.mlp.experts"]) == {}  # no input quantized
    for bad, match in (
        ("yes", "act_headroom 'yes'"),
        ({"rho": 30000}, "rho 30000.0: choose it in"),
        ({"anchor_percentile": 0}, "anchor_percentile 0.0"),
        ({"rh0": 4}, "act_headroom"),
        ({"rho": "big"}, "rho 'big': write a number"),
    ):
        with pytest.raises(ConfigError, match=match):
            parse_recipe({"quantize": RULES, "act_headroom": bad}, "r")
