"""--calibrate-all-experts: every token also runs through every routed expert of its layer, for the
statistics only, so that no expert goes uncalibrated; the layer's output, and every other statistic,
stay what they are without it, and the export is the same bytes at every layout. Under AWQ, the
experts' statistics are those of the folded experts over every token."""

import glob
import json
import logging
import os
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load_file

import eprt
from eprt.families import reader_for
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.kernels import unit_act, unit_mlp
from eprt.loading.loader import load_parallel
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.models.layers import silu_mul
from eprt.models.moe import MoE
from eprt.parallel import ParallelState
from eprt.quant.calibrated import CalibrationRecord
from eprt.quant.formats import weight_format
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.loop.passes import layer_passes
from eprt.quant.loop.sequences import Schedule
from eprt.quant.recipe import parse_recipe
from eprt.quant.run.data import report_data
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.ep_checks import same_files
from tests.multiproc import free_port, run_world

# so few tokens that the router leaves some experts of a layer without one (8 experts, top-2)
N, T = 2, 3


@pytest.fixture(scope="module", params=["qwen3_moe", "kimi_k3"])
def ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return convert_hf(make_tiny(request.param, str(d / "hf"), dtype="fp32"), str(d / "ck"), progress=False)


def calibrate(ck_dir: str, samples: torch.Tensor, all_experts: bool):
    """(the calibrator, the final hidden states) of the layer-major engine over `samples`, in fp32."""
    with Checkpoint(ck_dir) as ck:
        targets = reader_for(ck.config.model_type, ck_dir).layout(ck.config).linear_modules()
        cal = Calibrator(None, targets, kv=True, all_experts=all_experts)
        with torch.inference_mode():
            rc = ResolvedCheckpoint.of(ck, torch.float32)
            engine = LayerEngine(
                ParallelState.single("cpu"),
                rc,
                samples,
                layer_passes(cal),
                schedule=Schedule.of(N, T, 1, group_tokens=T),
                progress=False,
            )
            return cal, engine.run(0, engine.embed()).hidden


def every_expert_amax(model, samples: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each MoE layer's experts module -> (w13 input amax [E], w2 input amax [E]), computed directly:
    the whole model's forward, then every expert on every token its routed experts read."""
    inputs = {}
    for name, moe in model.named_modules():
        if isinstance(moe, MoE):
            moe.register_forward_pre_hook(lambda m, args, name=name: inputs.setdefault(name, args[0]))
    with torch.inference_mode():
        model(samples)
        out = {}
        for name, x in inputs.items():
            moe = model.get_submodule(name)
            z = moe.route(x.reshape(-1, x.shape[-1]))[0]
            h = [moe.experts.act(*(z @ w13.T).chunk(2, dim=-1)) for w13 in moe.experts.w13]
            out[f"{name}.experts"] = (z.abs().amax().expand(len(h)), torch.stack([h_e.abs().amax() for h_e in h]))
    return out


def test_every_expert_is_calibrated_on_every_token_and_nothing_else_changes(ckpt):
    samples = torch.randint(0, 200, (N, T), generator=torch.Generator().manual_seed(0))
    routed, hidden = calibrate(ckpt, samples, all_experts=False)
    every, every_hidden = calibrate(ckpt, samples, all_experts=True)
    want = every_expert_amax(eprt.load_model(ckpt, dtype=torch.float32), samples)

    # without the switch, an expert the router sent nothing has nothing to be calibrated with
    unreached = {name: (tokens == 0) for name, tokens in routed.expert_tokens.items()}
    assert any(u.any() for u in unreached.values()), "the data must leave some expert without a token"
    for name, u in unreached.items():
        assert not any(amax[u].any() for amax in routed.expert_amax[name]), name

    # with it, every expert's amax is that of every token of its layer, through it
    assert every.expert_amax.keys() == want.keys() and want
    for name, (w13_in, w2_in) in want.items():
        got = every.expert_amax[name]
        assert (got[0] > 0).all() and (got[1] > 0).all(), name
        torch.testing.assert_close(torch.stack(got), torch.stack([w13_in, w2_in]), rtol=1e-5, atol=0, msg=name)
        assert torch.equal(every.expert_all_tokens[name], torch.full((8,), N * T)), name

    # the layer outputs, so every dense statistic, and the routed counts are those of a run without it
    assert torch.equal(every_hidden, hidden)
    assert every.input_amax.keys() == routed.input_amax.keys()
    assert all(torch.equal(every.input_amax[n], t) for n, t in routed.input_amax.items())
    assert all(torch.equal(torch.stack(every.kv_amax[n]), torch.stack(kv)) for n, kv in routed.kv_amax.items())
    assert all(torch.equal(every.expert_tokens[n], t) for n, t in routed.expert_tokens.items())
    assert not routed.expert_all_tokens


def _calibrate(ck: str, out: str, ep: int, port: int) -> None:
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, args(ck, os.path.join(out, f"w{state.world}-ep{ep}")))


def args(ck: str, out: str, recipe: str = "nvfp4", **kw) -> PTQArgs:
    """5 sequences in groups of 2: 3 work-unit groups, shared by the replicas of a layout with edp 2."""
    return PTQArgs(
        ck,
        recipe,
        out,
        **{
            "kv_cache": "fp8",
            "calib_size": 5,
            "seq_len": 6,
            "batch_size": 2,
            "group_tokens": 12,
            "dtype": "bf16",
            "progress": False,
            "calibrate_all_experts": True,
            **kw,
        },
    )


def calibration_record(path: str) -> dict[str, torch.Tensor]:
    """Every expert's statistics of a calibrated checkpoint, by tensor name."""
    with Checkpoint(path) as ck:
        return CalibrationRecord.read(ck).expert_tensors()


def test_the_export_is_the_same_bytes_at_every_layout_and_chunk(ckpt, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="eprt"):
        run_ptq(ParallelState.single("cpu"), args(ckpt, str(tmp_path / "w1-ep1")))
    coverage = [r.getMessage() for r in caplog.records if "all-experts statistics" in r.getMessage()]
    run_ptq(ParallelState.single("cpu"), args(ckpt, str(tmp_path / "chunk1"), chunk_size=1))
    run_world(_calibrate, 2, ckpt, str(tmp_path), 2, free_port(), timeout=200)
    run_world(_calibrate, 2, ckpt, str(tmp_path), 1, free_port(), timeout=200)
    ref = export_hf(str(tmp_path / "w1-ep1"), str(tmp_path / "export-w1-ep1"), progress=False)
    record = calibration_record(str(tmp_path / "w1-ep1"))
    for other in ("chunk1", "w2-ep2", "w2-ep1"):
        assert same_files(ref, export_hf(str(tmp_path / other), str(tmp_path / f"export-{other}"), progress=False)), (
            other
        )
        # the export keeps only the layer's largest expert amax: every expert's must agree too
        got = calibration_record(str(tmp_path / other))
        assert got.keys() == record.keys() and all(torch.equal(got[n], t) for n, t in record.items()), other

    # the switch is recorded with the calibration, and the coverage report gives both counts
    with Checkpoint(str(tmp_path / "w1-ep1")) as ck:
        assert ck.quantization["calibration"]["all_experts"] is True
    amax = [t for n, t in record.items() if n.endswith("_input_amax")]
    assert amax and all((t > 0).all() for t in amax)
    assert len(coverage) == len(amax) // 2
    assert all(f"tokens per expert min {5 * 6} / max {5 * 6}" in line for line in coverage), coverage


def test_a_resumed_run_keeps_both_counts_and_exports_the_same_bytes(tmp_path, monkeypatch, caplog):
    """DeepSeek-V3 (layer 0 dense, 1 and 2 MoE), killed in layer 2: the resume restores the
    all-experts counts of layer 1 with the rest, and refuses a work directory of a run without
    the switch."""
    ck = convert_hf(make_tiny("deepseek_v3", str(tmp_path / "hf"), dtype="fp32"), str(tmp_path / "ck"), progress=False)
    single = ParallelState.single("cpu")
    run_ptq(single, args(ck, str(tmp_path / "whole")))
    out = str(tmp_path / "q")
    run_step = LayerEngine._run_step

    def dying(self, layer, step, ls, **kw):
        if layer is self.decoder.layers[2]:
            raise RuntimeError("killed")
        return run_step(self, layer, step, ls, **kw)

    monkeypatch.setattr(LayerEngine, "_run_step", dying)
    with pytest.raises(Exception, match="killed"):
        run_ptq(single, args(ck, out))
    monkeypatch.setattr(LayerEngine, "_run_step", run_step)
    with pytest.raises(Exception, match="other arguments"):
        run_ptq(single, args(ck, out, resume=True, calibrate_all_experts=False))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="eprt"):
        assert run_ptq(single, args(ck, out, resume=True))["resumed_after"] == 1
    coverage = [r.getMessage() for r in caplog.records if "all-experts statistics" in r.getMessage()]
    assert len(coverage) == 2 and all(f"min {5 * 6} / max {5 * 6}" in line for line in coverage), coverage
    assert same_files(
        export_hf(str(tmp_path / "whole"), str(tmp_path / "export-whole"), progress=False),
        export_hf(out, str(tmp_path / "export-q"), progress=False),
    )


def test_the_statistics_pass_computes_a_unit_as_the_routed_units_do():
    """unit_act's act(gate, up) of each unit has the bits unit_mlp gives the same rows of one expert."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(40, 16, generator=g).bfloat16()
    w13, w2 = torch.randn(2, 2 * 8, 16, generator=g).bfloat16(), torch.randn(2, 16, 8, generator=g).bfloat16()
    units = torch.tensor([17, 0, 23])
    h = unit_act(x, w13[1:2], silu_mul, units)
    h_routed, _ = unit_mlp(x, w13[1:2], w2[1:2], silu_mul, units[None])
    assert torch.equal(h, h_routed)
    torch.testing.assert_close(
        h, silu_mul(*(x.float() @ w13[1].float().T).chunk(2, dim=-1)).bfloat16(), rtol=2e-2, atol=1e-2
    )


# AWQ over every expert: fp32, so that the oracle's plain forward computes what the layer loop does
# to the last bits or nearly; no quality report
AWQ = dict(algorithm="awq", dtype="fp32", eval_size=0)
# Qwen3-MoE's tiny model: MoE layers 0 and 2. AWQ folds layer 0 (and 1) and measures it again;
# layer 2 keeps max, so its statistics are the statistics run's (JSON is YAML)
FOLDED, KEPT = "model.layers.0.mlp.experts", "model.layers.2.mlp.experts"
RECIPE = {
    "name": "nvfp4 awq but layer 2",
    "quantize": [
        {"pattern": "model.layers.2.*", "format": "nvfp4", "algorithm": "max"},
        {"pattern": "*", "format": "nvfp4"},
    ],
    "kv_cache": None,
}


@pytest.fixture(scope="module")
def awq_run(tmp_path_factory):
    """(the checkpoint, the recipe file, its AWQ calibration over every expert in one process, its
    export, the calibration sequences)."""
    d = tmp_path_factory.mktemp("awq")
    ck = convert_hf(make_tiny("qwen3_moe", str(d / "hf"), dtype="fp32"), str(d / "ck"), progress=False)
    recipe = d / "recipe.yaml"
    recipe.write_text(json.dumps(RECIPE))
    a = args(ck, str(d / "w1"), str(recipe), **AWQ)
    run_ptq(ParallelState.single("cpu"), a)
    with Checkpoint(ck) as c:
        samples = report_data(a, c.hf_files_dir(), c.config.vocab_size).samples
    return ck, str(recipe), a.out, export_hf(a.out, str(d / "export-w1"), progress=False), samples


def test_awq_calibrates_the_folded_experts_on_every_token(awq_run):
    """The experts' amax, and the exported input scales, are those of every token through every
    expert as the export folds it (inputs x / s, activations h / s), by a plain forward of the
    folded model; not the statistics run's, before the folds, nor those of the routed tokens alone;
    and on the layer AWQ leaves as it is, the statistics run's over every token."""
    ck, _, out, exported, samples = awq_run
    single = ParallelState.single("cpu")
    with Checkpoint(out) as q:
        record = CalibrationRecord.read(q)
        folded_model = load_parallel(ResolvedCheckpoint.of(record.view(q), torch.float32), single)
        folded = every_expert_amax(folded_model, samples)
        num_experts, recipe = q.config.num_experts, parse_recipe(q.quantization["recipe"], out)
    before = every_expert_amax(eprt.load_model(ck, dtype=torch.float32), samples)

    assert record.expert_input_amax.keys() == folded.keys() == before.keys() == {FOLDED, KEPT}
    folds = record.parts["awq"].tensors()
    assert any(n.startswith(FOLDED) for n in folds) and not any(n.startswith(KEPT) for n in folds)
    # AWQ folded layer 0's experts' input and activation: the amax before the folds are not these
    assert not torch.allclose(folded[FOLDED][0], before[FOLDED][0], rtol=1e-3)
    assert not torch.allclose(folded[FOLDED][1], before[FOLDED][1], rtol=1e-3)
    for name, (w13_in, w2_in) in folded.items():
        got = torch.stack(record.expert_input_amax[name])
        torch.testing.assert_close(got, torch.stack([w13_in, w2_in]), rtol=1e-5, atol=0, msg=name)

    # the export's: each projection kind's one input scale, from its experts' largest amax
    tensors = {n: t for f in glob.glob(os.path.join(exported, "*.safetensors")) for n, t in load_file(f).items()}
    got = {n: t for n, t in tensors.items() if ".experts." in n and n.endswith(".input_scale")}
    want = {
        f"{name}.{e}.{proj}.input_scale": weight_format(recipe.format_of(name)).scale(amax.max())
        for name, (w13_in, w2_in) in folded.items()
        for proj, amax in (("gate_proj", w13_in), ("up_proj", w13_in), ("down_proj", w2_in))
        for e in range(num_experts)
    }
    assert got.keys() == want.keys()
    for n, t in want.items():
        torch.testing.assert_close(got[n].float(), t.float(), rtol=1e-5, atol=0, msg=n)


def _calibrate_awq(ck: str, recipe: str, out: str, port: int) -> None:
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, args(ck, out, recipe, batch_size=3, **AWQ))


def test_awq_over_every_expert_is_the_same_bytes_at_world_2(awq_run, tmp_path):
    ck, recipe, out, exported, _ = awq_run
    run_world(_calibrate_awq, 2, ck, recipe, str(tmp_path / "w2"), free_port(), timeout=200)
    assert same_files(exported, export_hf(str(tmp_path / "w2"), str(tmp_path / "export-w2"), progress=False))
    # the export keeps each projection kind's largest amax: every expert's must agree too
    with Checkpoint(out) as w1, Checkpoint(str(tmp_path / "w2")) as w2:
        want, got = (CalibrationRecord.read(q).expert_input_amax for q in (w1, w2))
    assert got.keys() == want.keys() and all(torch.equal(torch.stack(got[n]), torch.stack(t)) for n, t in want.items())
