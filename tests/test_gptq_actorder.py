"""GPTQ's `actorder`, its default (eprt.quant.algorithms.gptq.solve.gptq): the columns swept by
descending Hessian diagonal, each rounded under its own block's scale, so that the export keeps its layout (no index of
each column's group), decodes with compressed-tensors, and stays the same bytes at every layout."""

from datetime import timedelta
from pathlib import Path

import pytest
import torch

from eprt.errors import ConfigError
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.parallel import ParallelState
from eprt.quant.algorithms.gptq.solve import columns_of, gptq
from eprt.quant.algorithms.registry import GPTQParams, parse_algorithm
from eprt.quant.formats import WEIGHT_FORMATS
from eprt.quant.formats.int4 import dequantize_int4
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.testing.tiny import make_tiny
from tests.ep_checks import same_files
from tests.formats_helpers import ct_scheme, decompressed
from tests.hf_utils import read_hf_tensors
from tests.multiproc import run_world
from tests.test_gptq import correlated_inputs

IN_ORDER = """name: int4_g32_in_order
quantize:
  - {pattern: "*", format: int4_g32, algorithm: {gptq: {actorder: false}}}
kv_cache: null
"""
CALIB = dict(calib_size=24, seq_len=64, progress=False, gptq_min_tokens=300)
FORMATS = ["int4_g32", "nvfp4", "mxfp4", "fp8_block", "fp8"]


def ordered_sweep(w: torch.Tensor, h: torch.Tensor, fmt: str, damp: float = 0.01) -> torch.Tensor:
    """Textbook GPTQ of one weight w [out, in] with its columns visited by descending diag(h), one
    column at a time (no lazy batches), each rounded by the format's rule at its own place."""
    cols = columns_of(fmt, w[None], w.abs().amax().reshape(1) / 400)
    order = torch.argsort(torch.diag(h), descending=True, stable=True)
    H = h.double()[order][:, order].clone()
    W = w.double()[:, order].clone()
    H += damp * torch.diag(H).mean() * torch.eye(H.shape[0], dtype=H.dtype)
    U = torch.linalg.cholesky(torch.linalg.inv(H), upper=True)
    Q = torch.zeros_like(W)
    for i, j in enumerate(order.tolist()):
        Q[:, i] = cols.round(j, W[None, :, i])[0].double()
        err = (W[:, i] - Q[:, i]) / U[i, i]
        W[:, i:] -= err[:, None] * U[None, i, i:]
    out = torch.empty_like(Q)
    out[:, order] = Q
    return out.float()


def uneven_hessian(dim: int, seed: int) -> torch.Tensor:
    """A Hessian whose diagonal is far from sorted: the order moves most columns."""
    x = correlated_inputs(4 * dim, dim, seed)
    x = x[:, torch.randperm(dim, generator=torch.Generator().manual_seed(seed))]
    return x.double().T @ x.double()


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_sweep_is_the_ordered_textbook_sweep(fmt):
    """Against a direct column-by-column reference, in every format GPTQ writes: the lazy batches
    (blocks of 32 over 128 columns) and the stack (three weights, each its own order) change no value."""
    dim = 128
    ws = [torch.randn(64, dim, generator=torch.Generator().manual_seed(10 + b)) for b in range(3)]
    hs = [uneven_hessian(dim, seed=20 + b) for b in range(3)]
    w = torch.stack(ws)
    cols = columns_of(fmt, w, w.abs().amax((1, 2)) / 400)
    got = gptq(w, torch.stack(hs), cols, block=32, actorder=True)
    for b in range(3):
        want = ordered_sweep(ws[b], hs[b], fmt)
        assert torch.equal(got[b], want), (fmt, b, (got[b] != want).sum().item())
    # the order is there: the unordered sweep gives other values
    assert not torch.equal(got, gptq(w, torch.stack(hs), cols, block=32))


def test_dead_columns_are_zero_and_the_rest_ordered():
    """A column no input reaches (zero diagonal) comes out zero wherever the order puts it."""
    h = uneven_hessian(64, seed=3)
    dead = torch.tensor([1, 17, 40])
    h[dead, :], h[:, dead] = 0.0, 0.0
    w = torch.randn(1, 32, 64, generator=torch.Generator().manual_seed(4))
    q = gptq(w, h[None], columns_of("int4_g32", w, torch.ones(1)), actorder=True)
    assert (q[0][:, dead] == 0).all() and (q[0][:, [0, 2, 63]] != 0).any()


def test_the_order_is_each_formats_default_and_a_rule_may_set_it():
    """Every format but FP8 block sweeps in the ordered way unless a rule says otherwise; a rule's
    true or false is recorded, so it holds for FP8 block too."""
    default = GPTQParams()
    assert [f for f in WEIGHT_FORMATS if not default.orders_columns(WEIGHT_FORMATS[f])] == ["fp8_block"]
    assert GPTQParams(actorder=True).orders_columns(WEIGHT_FORMATS["fp8_block"])
    assert not GPTQParams(actorder=False).orders_columns(WEIGHT_FORMATS["int4_g32"])
    assert parse_algorithm({"gptq": {"actorder": True}}, "rule") == ("gptq", (("gptq", (("actorder", True),)),))
    assert parse_algorithm({"gptq": {"actorder": False}}, "rule") == ("gptq", (("gptq", (("actorder", False),)),))
    with pytest.raises(ConfigError, match="give true or false .default the format's"):
        parse_algorithm({"gptq": {"actorder": 1}}, "rule")
    assert parse_algorithm(["awq", {"gptq": {"actorder": False}}], "rule")[0] == "awq+gptq"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq_actorder")
    hf = make_tiny("qwen3_moe", str(root / "hf"), dtype="bf16")
    recipe = root / "in_order.yaml"
    recipe.write_text(IN_ORDER)
    return hf, convert_hf(hf, str(root / "ck"), progress=False), str(recipe)


def _calibrate(ck: str, out: str, ep: int) -> None:
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, PTQArgs(ck, "int4_g32", out, algorithm="gptq", batch_size=2, **CALIB))


def test_the_export_is_the_same_bytes_at_every_layout_and_decodes_with_compressed_tensors(tiny, tmp_path):
    """GPTQ in its default order at (world, ep) (1, 1) and (2, 2): the same export bytes; not those
    of the columns in their order (`actorder: false`); and the library decompresses every quantized
    module (routed experts included) from the export's own tensors, with no g_idx among them, to
    eprt's values of its codes."""
    _, ck, in_order = tiny
    one = str(tmp_path / "w1")
    run_ptq(ParallelState.single(), PTQArgs(ck, "int4_g32", one, algorithm="gptq", batch_size=3, **CALIB))
    run_world(_calibrate, 2, ck, str(tmp_path / "w2"), 2, timeout=200)
    exports = [
        export_hf(q, str(tmp_path / f"export-{i}"), progress=False, fmt="compressed-tensors")
        for i, q in enumerate((one, str(tmp_path / "w2")))
    ]
    assert same_files(exports[0], exports[1])
    plain = str(tmp_path / "plain")
    run_ptq(ParallelState.single(), PTQArgs(ck, in_order, plain, algorithm="gptq", batch_size=3, **CALIB))
    plain_ct = export_hf(plain, str(tmp_path / "export-plain"), progress=False, fmt="compressed-tensors")
    assert not same_files(exports[0], plain_ct)

    tensors = read_hf_tensors(exports[0])
    assert sorted(tensors) == sorted(read_hf_tensors(plain_ct))  # the layout of plain GPTQ: no g_idx
    scheme, compressor = ct_scheme(exports[0])
    assert scheme.weights.actorder is None
    modules = sorted(n[: -len(".weight_packed")] for n in tensors if n.endswith(".weight_packed"))
    assert any(".experts." in m for m in modules) and any("self_attn" in m for m in modules)
    for m in modules:
        want = dequantize_int4(tensors[f"{m}.weight_packed"], tensors[f"{m}.weight_scale"], torch.bfloat16)
        assert torch.equal(decompressed(tensors, m, scheme, compressor), want), m
    assert Path(exports[0], "config.json").exists()
