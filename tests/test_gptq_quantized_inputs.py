"""GPTQ's `quantized_inputs` (eprt.quant.algorithms.gptq.solve.input_error_aim): the weight aimed at
computes from the inputs as the engine quantizes them what the original computes from the inputs as
they are, and the export stays the same bytes at every layout."""

from dataclasses import replace
from datetime import timedelta

import pytest
import torch

from eprt.errors import ConfigError
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.algorithms.gptq.solve import HessianSum, columns_of, gptq, input_error_aim
from eprt.quant.algorithms.program import program_of
from eprt.quant.algorithms.registry import parse_algorithm
from eprt.quant.formats.nvfp4 import fake_quant_nvfp4, nvfp4_scale
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.run.setup import plan_recipe
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.ep_checks import same_files
from tests.multiproc import run_world
from tests.test_gptq import correlated_inputs

RECIPE = """name: nvfp4_quantized_inputs
quantize:
  - {pattern: "*", format: nvfp4, algorithm: {gptq: {quantized_inputs: true}}}
kv_cache: null
"""
CALIB = dict(calib_size=24, seq_len=64, kv_cache="fp8", progress=False, gptq_min_tokens=300)


def sums_of(x: torch.Tensor, x_q: torch.Tensor, units: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """The Hessian of x_q and the cross sum (x - x_q)^T x_q, summed exactly unit by unit as a run sums them."""
    amax = 2 * x.abs().max().item()
    h, cross = HessianSum(x.shape[1], amax, x.shape[0]), HessianSum(x.shape[1], amax, x.shape[0])
    for rows, rows_q in zip(x.chunk(units), x_q.chunk(units)):
        h.add(rows_q)
        cross.add(rows.double() - rows_q.double(), rows_q)
    return h.hessian(), cross.hessian()


def test_the_aim_is_the_least_squares_weight_on_the_quantized_inputs():
    """argmin_W' ||X w^T - X~ W'^T||, against a direct least-squares solve (damping all but none)."""
    x = correlated_inputs(512, 48, seed=0)
    x_q = x + 0.05 * torch.randn(x.shape, generator=torch.Generator().manual_seed(1)) * x.abs().mean()
    w = torch.randn(24, 48, generator=torch.Generator().manual_seed(2))
    h, cross = sums_of(x, x_q)
    got = input_error_aim(w, h, cross, damp=1e-12)
    want = torch.linalg.lstsq(x_q.double(), x.double() @ w.double().T).solution.T
    assert torch.allclose(got, want, rtol=1e-7, atol=1e-9), (got - want).abs().max()
    # and it is not w: the inputs' error moved it
    assert (got - w.double()).abs().max() > 1e-3


def test_inputs_left_as_they_are_leave_the_aim_the_weight_bit_for_bit():
    x = correlated_inputs(256, 32, seed=3)
    w = torch.randn(16, 32, generator=torch.Generator().manual_seed(4))
    h, cross = sums_of(x, x.clone())
    assert torch.equal(input_error_aim(w, h, cross), w.double())


def test_gptq_of_the_aim_lowers_the_output_error_from_nvfp4_inputs():
    """||X w^T - X~ Q^T|| with X~ the NVFP4 inputs: GPTQ aimed at input_error_aim's weight under
    X~'s Hessian is below GPTQ of w under X's (today's), and below GPTQ of w under X~'s alone."""
    x = correlated_inputs(1024, 64, seed=5)
    x_q = fake_quant_nvfp4(x, nvfp4_scale(x.abs().max()))
    w = torch.randn(32, 64, generator=torch.Generator().manual_seed(6)) / 8
    cols = lambda: columns_of("nvfp4", w[None], nvfp4_scale(w.abs().max()).reshape(1))  # noqa: E731
    h_q, cross = sums_of(x, x_q)
    h = x.double().T @ x.double()

    def error(q: torch.Tensor) -> float:
        return (x.double() @ w.double().T - x_q.double() @ q[0].double().T).square().sum().item()

    today = error(gptq(w[None], h[None], cols()))
    quantized_hessian = error(gptq(w[None], h_q[None], cols()))
    aimed = error(gptq(input_error_aim(w, h_q, cross)[None].float(), h_q[None], cols()))
    assert aimed < 0.97 * min(today, quantized_hessian), (aimed, today, quantized_hessian)


def test_the_parameter_is_a_boolean_and_recorded_only_where_set():
    assert parse_algorithm({"gptq": {"quantized_inputs": True}}, "rule") == (
        "gptq",
        (("gptq", (("quantized_inputs", True),)),),
    )
    assert parse_algorithm({"gptq": {"quantized_inputs": False}}, "rule") == ("gptq", ())
    assert parse_algorithm(["awq", {"gptq": {"quantized_inputs": True}}], "rule")[0] == "awq+gptq"
    with pytest.raises(ConfigError, match="quantized_inputs 1: give true or false"):
        parse_algorithm({"gptq": {"quantized_inputs": 1}}, "rule")
    with pytest.raises(ConfigError, match="damp True: give a positive float"):
        parse_algorithm({"gptq": {"damp": True}}, "rule")


def test_the_memory_plan_counts_the_cross_sums(tiny):
    """Each Linear the recipe quantizes keeps its int64 sums twice over (its Hessian and its cross
    sum); the rest is plain GPTQ's plan."""
    _, ck_dir, recipe = tiny
    with Checkpoint(ck_dir) as ck:
        rc = ResolvedCheckpoint.of(ck, torch.float32)
        plans = [plan_recipe(rc, r, None, "gptq") for r in ("nvfp4", recipe)]
        (plain,), (cross,) = (program_of(*p).planner(rc, torch.device("cpu")).algorithms for p in plans)
        _, targets = plans[1]
    assert plain.hessians.keys() == cross.hessians.keys()
    for layer, linears in plain.hessians.items():
        doubled = [c.hessian == 2 * p.hessian for p, c in zip(linears, cross.hessians[layer])]
        assert [
            replace(c, hessian=p.hessian * (1 + d)) for p, c, d in zip(linears, cross.hessians[layer], doubled)
        ] == [replace(p, hessian=p.hessian * (1 + d)) for p, d in zip(linears, doubled)]
        # a routed experts module is two weights (gate/up stacked, down)
        mine = [m for m in targets if f"layers.{layer}." in m]
        assert sum(doubled) == sum(2 if m.endswith(".experts") else 1 for m in mine) > 0, layer


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq_quantized_inputs")
    hf = make_tiny("qwen3_moe", str(root / "hf"), dtype="bf16")
    recipe = root / "recipe.yaml"
    recipe.write_text(RECIPE)
    return hf, convert_hf(hf, str(root / "ck"), progress=False), str(recipe)


def _calibrate(ck: str, recipe: str, out: str, ep: int) -> None:
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, PTQArgs(ck, recipe, out, algorithm="gptq", batch_size=2, **CALIB))


def test_the_export_is_the_same_bytes_at_every_layout_and_moves_from_plain_gptq(tiny, tmp_path):
    """(world, ep) (1, 1) and (2, 2): the same export bytes; and not plain GPTQ's."""
    _, ck, recipe = tiny
    one = str(tmp_path / "w1")
    run_ptq(ParallelState.single(), PTQArgs(ck, recipe, one, algorithm="gptq", batch_size=3, **CALIB))
    run_world(_calibrate, 2, ck, recipe, str(tmp_path / "w2"), 2, timeout=200)
    exports = [
        export_hf(q, str(tmp_path / f"export-{i}"), progress=False) for i, q in enumerate((one, str(tmp_path / "w2")))
    ]
    assert same_files(exports[0], exports[1])
    plain = str(tmp_path / "plain")
    run_ptq(ParallelState.single(), PTQArgs(ck, "nvfp4", plain, algorithm="gptq", batch_size=3, **CALIB))
    assert not same_files(exports[0], export_hf(plain, str(tmp_path / "export-plain"), progress=False))
