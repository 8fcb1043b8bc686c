"""GPTQ (eprt.quant.algorithms.gptq.solve): exact layout-free Hessians, the solve in the export's numerics."""

import hashlib
import os
from datetime import timedelta

import pytest
import torch
from safetensors.torch import load_file

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.hf.export_quantized import QuantizedExport
from eprt.parallel import ParallelState
from eprt.quant.algorithms.gptq import layer as gptq_layer
from eprt.quant.algorithms.gptq.layer import MOST_EXPERTS_STACKED, LayerGPTQ
from eprt.quant.algorithms.gptq.plan import GPTQMemory
from eprt.quant.algorithms.gptq.solve import HessianSum, columns_of, gptq
from eprt.quant.formats.fp8 import dequantize_fp8, fp8_scale, quantize_fp8
from eprt.quant.formats.nvfp4 import dequantize_nvfp4, nvfp4_scale, quantize_nvfp4
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.run import workdir
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.scales import as_quantized, dequantize_weight
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.ep_checks import same_files
from tests.multiproc import run_world

SCALE = {"fp8": fp8_scale, "nvfp4": nvfp4_scale}


def correlated_inputs(n: int, dim: int, seed: int) -> torch.Tensor:
    """Rows with correlated features and a few large channels, as a Linear's inputs are."""
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(dim, dim, generator=g) / dim**0.5 + torch.eye(dim)
    x = torch.randn(n, dim, generator=g) @ mix
    x[:, :4] *= 8
    return x


def round_to_nearest(fmt: str, w: torch.Tensor) -> torch.Tensor:
    """The max path's weight: the export's encoding of w, dequantized."""
    scale = SCALE[fmt](w.abs().amax())
    if fmt == "fp8":
        return dequantize_fp8(quantize_fp8(w, scale), scale)
    return dequantize_nvfp4(*quantize_nvfp4(w, scale), scale)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_gptq_beats_round_to_nearest_and_is_representable(fmt):
    torch.manual_seed(0)
    w = torch.randn(48, 160) * 0.05
    x = correlated_inputs(600, 160, seed=1)
    hs = HessianSum(160, x.abs().max().item(), x.shape[0])
    hs.add(x)
    cols = columns_of(fmt, w[None], SCALE[fmt](w.abs().amax()).reshape(1))
    q = gptq(w[None], hs.hessian()[None], cols, block=64)  # more than one lazy-batch block
    err = lambda wq: torch.linalg.norm(x @ wq.T - x @ w.T).item()  # noqa: E731
    assert err(q[0]) < 0.9 * err(round_to_nearest(fmt, w)), (err(q[0]), err(round_to_nearest(fmt, w)))
    # exactly representable: the export's encoder, under the scales fixed from w, gives codes
    # that decode to GPTQ's weight bit for bit
    codes = cols.encode(q)
    assert torch.equal(cols.decode(codes), q)
    if fmt == "nvfp4":  # the block scales are the export's, from the original weight
        assert torch.equal(
            cols.block_scale[0].view(torch.uint8), quantize_nvfp4(w, SCALE[fmt](w.abs().amax()))[1].view(torch.uint8)
        )


def test_gptq_zero_inputs_leave_dead_columns_zero():
    w = torch.randn(16, 32)
    x = correlated_inputs(64, 32, seed=2)
    x[:, 5] = 0  # a channel no token uses
    hs = HessianSum(32, x.abs().max().item(), 64)
    hs.add(x)
    h = hs.hessian()[None]
    q = gptq(w[None], h, columns_of("nvfp4", w[None], nvfp4_scale(w.abs().amax()).reshape(1)))
    assert torch.all(q[0, :, 5] == 0)
    assert torch.isfinite(q).all()
    assert torch.equal(h, hs.hessian()[None])  # the caller's Hessian as it was: a stack may be solved again


def test_gptq_takes_the_hessians_one_at_a_time_with_the_same_bits():
    """A generator of Hessians (each made as it is factored, one held at a time) solves as the stack does."""
    w = torch.randn(3, 16, 48)
    h = torch.stack([(lambda x: x.T @ x)(correlated_inputs(100, 48, seed=s).double()) for s in range(3)])
    cols = columns_of("fp8", w, torch.stack([fp8_scale(x.abs().amax()) for x in w]))
    assert torch.equal(gptq(w, (hb.clone() for hb in h), cols), gptq(w, h, cols))
    with pytest.raises(ValueError, match="GPTQ: 2 Hessians for a stack of 3 weights"):
        gptq(w, h[:2], cols)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_gptq_of_a_stack_is_each_weight_solved_alone(fmt):
    """A rank solves its routed experts together: each comes out the same bits as alone, so which
    experts share a rank (the ep degree) changes nothing."""
    torch.manual_seed(3)
    w = torch.randn(3, 16, 48)
    h = torch.stack([(lambda x: x.T @ x)(correlated_inputs(100, 48, seed=s).double()) for s in range(3)])
    scales = torch.stack([SCALE[fmt](x.abs().amax()) for x in w])
    together = gptq(w, h, columns_of(fmt, w, scales), block=32)
    for b in range(3):
        alone = gptq(w[b : b + 1], h[b : b + 1], columns_of(fmt, w[b : b + 1], scales[b : b + 1]), block=32)
        assert torch.equal(together[b], alone[0]), b


def test_hessian_is_the_same_bits_for_any_split_of_the_units():
    """Units summed in any order, on any number of partial sums added later (the ranks and
    their all_reduce), give the same Hessian, where fp64 sums in those orders do not."""
    x = correlated_inputs(1000, 48, seed=3)  # fp32: products of bf16 values would sum exactly in fp64
    units = list(x.split([37, 1, 200, 90, 0, 300, 128, 244]))
    amax = x.abs().max().item()

    one = HessianSum(48, amax, x.shape[0])
    for u in units:
        one.add(u)
    split = [HessianSum(48, amax, x.shape[0]) for _ in range(3)]
    for i, u in enumerate(reversed(units)):
        split[i % 3].add(u)
    total = split[2].total + split[0].total + split[1].total
    assert torch.equal(one.total, total)
    # what the fixed point is for: plain fp64 partial sums depend on the order
    plain = lambda order: sum(
        (u.double().T @ u.double() for u in order),  # noqa: E731
        torch.zeros(48, 48, dtype=torch.float64),
    )
    assert not torch.equal(plain(units), plain(reversed(units)))
    # and it is the Hessian: within fp64's rounding of the partials
    want = x.double().T @ x.double()
    assert torch.allclose(one.hessian(), want, rtol=1e-12, atol=1e-9 * want.abs().max().item())


def test_hessian_refuses_rows_above_the_amax_it_was_sized_for():
    hs = HessianSum(4, 1.0, 10)
    with pytest.raises(ValueError, match="above the calibrated input amax"):
        hs.add(torch.tensor([[0.5, 2.0, 0.0, 0.0]]))


# --- GPTQ in the engine, on a tiny Qwen3-MoE -------------------------------------------------

CALIB = dict(calib_size=24, seq_len=64)  # ~380 tokens per routed expert: most have 256 or more


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("gptq")
    hf = make_tiny("qwen3_moe", str(root / "hf"), dtype="bf16")
    return hf, convert_hf(hf, str(root / "ck"), progress=False)


def hessians_of_run(setattr_) -> dict:
    """Patches LayerGPTQ.quantize through `setattr_` (pytest's monkeypatch.setattr, or setattr) to
    record the Hessians GPTQ solves with (summed over the ranks), by dense module or (module,
    local expert, kind) with the expert's token count."""
    seen = {}
    quantize = LayerGPTQ.quantize

    def spy(self):
        quantize(self)
        seen.update({m: hs.hessian() for m, hs in self.hessians.items()})
        for m, sums in self.expert_hessians.items():
            for l, pair in sums.items():
                for kind, hs in zip(("w13", "w2"), pair):
                    seen[(m, l, kind)] = (hs.hessian(), int(self.stats.expert_tokens[m][l]))

    setattr_(LayerGPTQ, "quantize", spy)
    return seen


def output_error(w_q: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    """||X w_q^T - X w^T||^2 over the rows X whose sum of x x^T is h."""
    d = w_q.double() - w.double()
    return torch.einsum("oi,ij,oj->", d, h, d).item()


def layer_output_errors(q: str, hessians: dict) -> list[tuple[str, int | None, float, float]]:
    """(Linear, tokens (None: dense), GPTQ's output error, max rounding's) of every Linear GPTQ ran
    on in single-process calibrated checkpoint q, on the inputs of `hessians_of_run`. Max rounding
    is the export's encoding of the source weight under the same scales."""
    out = []
    with Checkpoint(q) as cq:
        exp = QuantizedExport(cq)
        for key, h in hessians.items():
            if isinstance(key, str):
                m, name, tokens = key, f"{key}.weight", None
                w = as_quantized(cq, name, exp.scales.formats[m], cq.read(name))
                got, scale = exp.quantize(name), exp.scales.weight_scale(m)
            else:
                (m, e, kind), (h, tokens) = key, h
                name = f"{m}.{kind}"
                w = exp.expert_row(name, e)
                got, scale = exp.quantized_row(name, m, e), exp.scales.expert_weight_scale(m, w)
            fmt = exp.scales.formats[m]
            rtn = exp.scales.quantize_weight(m, w, scale)
            out.append(
                (
                    f"{name}[{key[1]}]" if tokens is not None else name,
                    tokens,
                    output_error(dequantize_weight(fmt, got, torch.float32), w, h),
                    output_error(dequantize_weight(fmt, rtn, torch.float32), w, h),
                )
            )
    return out


@pytest.mark.parametrize("recipe", ["nvfp4", "fp8"])
def test_gptq_layer_output_error_is_below_max_rounding(tiny, tmp_path, monkeypatch, recipe):
    """On its calibration inputs, each Linear's output error under GPTQ's weight is below max
    rounding's: on every dense Linear, and on at least 90% of the routed experts' projections
    with 256 tokens or more."""
    _, ck = tiny
    hessians = hessians_of_run(monkeypatch.setattr)
    q = str(tmp_path / "q")
    run_ptq(ParallelState.single(), PTQArgs(ck, recipe, q, kv_cache="fp8", algorithm="gptq", progress=False, **CALIB))
    errors = layer_output_errors(q, hessians)
    dense = [(name, g, m) for name, tokens, g, m in errors if tokens is None]
    with Checkpoint(q) as cq:  # every dense Linear the recipe quantizes
        assert len(dense) == len([m for m in QuantizedExport(cq).quantized if not m.endswith(".experts")]) > 0
    assert all(g < m for _, g, m in dense), [d for d in dense if d[1] >= d[2]]
    experts = [(g, m) for _, tokens, g, m in errors if tokens is not None and tokens >= 256]
    # two MoE layers of 8 experts, two projections each, most with enough tokens
    assert len(experts) >= 16, len(experts)
    assert sum(g < m for g, m in experts) >= 0.9 * len(experts), experts


def digest(hs: HessianSum) -> str:
    return hashlib.sha256(hs.total.numpy().tobytes()).hexdigest()


def load_dir(d: str) -> dict[str, torch.Tensor]:
    return {
        n: t
        for f in sorted(os.listdir(d))
        if f.endswith(".safetensors")
        for n, t in load_file(os.path.join(d, f)).items()
    }


def record_hessians() -> dict:
    """Patches LayerGPTQ.quantize (in this process) to record the bytes of every Hessian it sums
    over the ranks, by module (dense) or (module, global expert, kind)."""
    seen = {}
    quantize = LayerGPTQ.quantize

    def spy(self):
        quantize(self)
        seen.update({m: digest(hs) for m, hs in self.hessians.items()})
        for m, sums in self.expert_hessians.items():
            first = self._module(m).first
            for l, pair in sums.items():
                seen.update({(m, first + l, kind): digest(hs) for kind, hs in zip(("w13", "w2"), pair)})

    LayerGPTQ.quantize = spy
    return seen


def _calibrate_gptq(ck: str, out: str, ep: int) -> dict:
    seen = record_hessians()
    with ParallelState.from_env(ep=ep, timeout=timedelta(seconds=60)) as state:
        run_ptq(
            state,
            PTQArgs(
                ck,
                "nvfp4",
                out,
                kv_cache="fp8",
                algorithm="gptq",
                batch_size=2,
                progress=False,
                gptq_min_tokens=300,
                **CALIB,
            ),
        )
    return seen


def test_gptq_export_is_the_same_bytes_at_every_layout_and_passes_the_checks(tiny, tmp_path, monkeypatch):
    """(world, ep) (1, 1), (2, 2) and (2, 1) (each expert's units split over two replicas): the
    same Hessians to the bit, the same export bytes."""
    hf, ck = tiny
    one = str(tmp_path / "w1")
    monkeypatch.setattr(LayerGPTQ, "quantize", LayerGPTQ.quantize)  # restored after the test
    want = record_hessians()
    run_ptq(
        ParallelState.single(),
        PTQArgs(
            ck,
            "nvfp4",
            one,
            kv_cache="fp8",
            algorithm="gptq",
            batch_size=3,
            progress=False,
            gptq_min_tokens=300,
            **CALIB,
        ),
    )
    for ep in (2, 1):
        ranks = run_world(_calibrate_gptq, 2, ck, str(tmp_path / f"w2-ep{ep}"), ep, timeout=200)
        assert {k: v for r in ranks for k, v in r.items()} == want, ep
    with Checkpoint(one) as cq:  # some experts kept max rounding, and are listed
        skipped = cq.quantization["calibration"]["gptq_skipped_experts"]
        assert skipped and all(isinstance(e, int) for ids in skipped.values() for e in ids), skipped
    exports = [
        export_hf(q, str(tmp_path / f"export-{i}"), progress=False)
        for i, q in enumerate((one, str(tmp_path / "w2-ep2"), str(tmp_path / "w2-ep1")))
    ]
    assert check_export(exports[0], hf) == []
    assert same_files(exports[0], exports[1]) and same_files(exports[0], exports[2])
    # compressed-tensors' layout carries the same codes
    ct = export_hf(one, str(tmp_path / "export-ct"), progress=False, fmt="compressed-tensors")
    assert check_export(ct, hf) == []
    modelopt, packed = load_dir(exports[0]), load_dir(ct)
    codes = {n: t for n, t in modelopt.items() if n.endswith(".weight") and t.dtype == torch.uint8}
    assert codes and all(torch.equal(packed[n + "_packed"], t) for n, t in codes.items())
    # GPTQ changed the weights: not the max export's
    run_ptq(
        ParallelState.single(), PTQArgs(ck, "nvfp4", str(tmp_path / "max"), kv_cache="fp8", progress=False, **CALIB)
    )
    assert not same_files(exports[0], export_hf(str(tmp_path / "max"), str(tmp_path / "export-max"), progress=False))


def test_gptq_resumes_after_its_last_completed_layer_with_the_same_bytes(tiny, tmp_path, monkeypatch):
    """GPTQ's codes of each layer done are saved at its layer boundary: a run stopped in layer 2
    resumes after layer 1 and writes what a run never stopped writes."""
    _, ck = tiny
    args = lambda out, **kw: PTQArgs(
        ck,
        "fp8",
        str(tmp_path / out),
        algorithm="gptq",
        progress=False,  # noqa: E731
        **CALIB,
        **kw,
    )
    run_ptq(ParallelState.single(), args("whole"))
    run_layer = LayerEngine.run_layer

    def stopping(self, i, ls, pb):
        if i == 2:
            raise RuntimeError("stopped in layer 2")
        return run_layer(self, i, ls, pb)

    monkeypatch.setattr(LayerEngine, "run_layer", stopping)
    with pytest.raises(Exception, match="stopped in layer 2"):
        run_ptq(ParallelState.single(), args("q"))
    monkeypatch.setattr(LayerEngine, "run_layer", run_layer)
    # each completed layer's codes in a file of their own, the last completed layer's states beside them
    work = tmp_path / "q.work" / "rank-00000"
    assert sorted(os.listdir(work)) == ["gptq-00000.safetensors", "gptq-00001.safetensors", "layer-00001.safetensors"]
    assert run_ptq(ParallelState.single(), args("q", resume=True))["resumed_after"] == 1
    assert not os.path.exists(tmp_path / "q.work")  # the codes' files removed with the rest
    exports = [export_hf(str(tmp_path / q), str(tmp_path / f"export-{q}"), progress=False) for q in ("whole", "q")]
    assert same_files(*exports)


def gptq_bytes_per_layer_boundary(tmp_path, layers: int, monkeypatch) -> list[int]:
    """The bytes of GPTQ codes each layer boundary writes to the work directory, in a run of a
    tiny Qwen3-MoE of `layers` like layers."""
    written = []
    save = workdir.save_tensors

    def counting(path, tensors, metadata=None):
        written.append(sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith("gptq")))
        return save(path, tensors, metadata)

    monkeypatch.setattr(workdir, "save_tensors", counting)
    hf = make_tiny("qwen3_moe", str(tmp_path / f"hf{layers}"), num_hidden_layers=layers, mlp_only_layers=[])
    ck = convert_hf(hf, str(tmp_path / f"ck{layers}"), progress=False)
    run_ptq(
        ParallelState.single(),
        PTQArgs(ck, "fp8", str(tmp_path / f"q{layers}"), algorithm="gptq", calib_size=4, seq_len=16, progress=False),
    )
    return [n for n in written if n]


def test_gptq_work_dir_writes_each_layers_codes_once(tmp_path, monkeypatch):
    """At 4 layers and at 16 every layer boundary writes one layer's codes: the work written grows
    with the layers, not with their square."""
    four, sixteen = (gptq_bytes_per_layer_boundary(tmp_path, n, monkeypatch) for n in (4, 16))
    assert four == four[:1] * 4 and sixteen == four[:1] * 16, (four, sixteen)


def test_a_min_token_count_below_one_is_refused_by_name(tiny, tmp_path):
    _, ck = tiny
    with pytest.raises(Exception, match="ConfigError: --gptq-min-tokens 0 must be positive"):
        run_ptq(
            ParallelState.single(),
            PTQArgs(ck, "nvfp4", str(tmp_path / "q"), algorithm="gptq", gptq_min_tokens=0, progress=False, **CALIB),
        )
    assert not os.path.exists(tmp_path / "q")


def test_the_expert_stack_the_memory_allows_changes_no_byte(tiny, tmp_path, monkeypatch):
    """A run whose memory allows one expert at a time writes what a run that solves them 16 at a
    time writes."""
    _, ck = tiny
    stacks = []
    solve = gptq_layer.gptq
    monkeypatch.setattr(
        gptq_layer, "gptq", lambda w, h, cols, **kw: (stacks.append(w.shape[0]), solve(w, h, cols, **kw))[1]
    )
    exports = []
    for most in (MOST_EXPERTS_STACKED, 1):
        monkeypatch.setattr(GPTQMemory, "most_stacked", most)
        q = str(tmp_path / f"q{most}")
        run_ptq(
            ParallelState.single(), PTQArgs(ck, "nvfp4", q, kv_cache="fp8", algorithm="gptq", progress=False, **CALIB)
        )
        exports.append(export_hf(q, str(tmp_path / f"export{most}"), progress=False))
        stacks.append(None)
    together, alone = stacks[: stacks.index(None)], stacks[stacks.index(None) + 1 : -1]
    assert max(together) > 1 and set(alone) == {1}, stacks
    assert same_files(*exports)
