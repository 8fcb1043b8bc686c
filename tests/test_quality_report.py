"""The PTQ quality report: its fake quantization is the export's numerics bit for bit, its numbers
are those of the whole model run unquantized and fake-quantized, it is written into the
calibrated checkpoint and the export and printed on rank 0, and every layout reports the same."""

import json
import logging
import math
import os
import re
import threading
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch

from eprt.data import held_out_samples
from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.loading.loader import load_model, load_parallel
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.models.layers import GatedMLP
from eprt.parallel import ParallelState
from eprt.parallel.guard import RankFailure
from eprt.progress import logger
from eprt.quant import quality
from eprt.quant.algorithms.awq import passes as awq_pass
from eprt.quant.algorithms.awq.folds import FoldedCheckpoint
from eprt.quant.calibrated import QUALITY_FILE, CalibrationRecord
from eprt.quant.formats.e2m1 import E2M1_VALUES, unpack_fp4
from eprt.quant.formats.fp8 import fake_quant_fp8, fp8_scale
from eprt.quant.quality import Probes, expert_parts
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.report.schema import read_report_json
from eprt.storage.checkpoint import MANIFEST, Checkpoint
from eprt.storage.hf_files import QUALITY, QUALITY_PAGE
from eprt.testing.tiny import make_tiny
from tests.formats_helpers import fake_quantized_model
from tests.hf_utils import read_hf_tensors
from tests.multiproc import run_world

SEQ_LEN, CALIB, EVAL = 24, 9, 6


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    d = tmp_path_factory.mktemp("quality")
    # qwen3_moe: GQA, routed experts in layers 0 and 2, a dense MLP in layer 1; deepseek_v3: MLA,
    # shared experts, a dense first layer
    return {
        f: convert_hf(make_tiny(f, str(d / f / "hf")), str(d / f / "ck"), progress=False)
        for f in ("qwen3_moe", "deepseek_v3")
    }


def args(ck, out, recipe="nvfp4", dtype="fp32", **kw):
    return PTQArgs(
        ck,
        recipe,
        out,
        kv_cache="fp8",
        calib_size=CALIB,
        seq_len=SEQ_LEN,
        group_tokens=48,
        dtype=dtype,
        progress=False,
        **{"eval_size": EVAL, **kw},
    )


def dequantized(tensors: dict, module: str) -> torch.Tensor:
    """A quantized Linear's weight from the export's bytes: FP8 x weight_scale, or NVFP4's E2M1
    value x its FP8 block scale x weight_scale_2."""
    w, scale = tensors[f"{module}.weight"], tensors[f"{module}.weight_scale"]
    if w.dtype == torch.float8_e4m3fn:
        return w.float() * scale
    table = torch.tensor(E2M1_VALUES + tuple(-v for v in E2M1_VALUES))
    values = table[unpack_fp4(w).long()].reshape(w.shape[0], -1, 16)
    return (values * scale.float()[..., None] * tensors[f"{module}.weight_scale_2"]).reshape(w.shape[0], -1)


@pytest.mark.parametrize(
    "recipe, dtype, algorithm",
    [
        ("fp8", "fp32", "max"),
        ("nvfp4", "bf16", "max"),
        ("nvfp4", "bf16", "mse"),
        ("fp8", "fp32", "gptq"),
        ("nvfp4", "bf16", "gptq"),
    ],
)
def test_the_reports_weights_are_the_exports_dequantized_bit_for_bit(ckpts, tmp_path, recipe, dtype, algorithm):
    """fp32 from a bf16 source: FP8 rounds its quotient to the source's dtype, as the export does.
    With mse, the searched scales; with gptq, GPTQ's codes (every routed expert's too)."""
    seen = {}
    q = str(tmp_path / "q")
    run_ptq(
        ParallelState.single("cpu"),
        args(ckpts["qwen3_moe"], q, recipe, dtype, algorithm=algorithm, gptq_min_tokens=1),
        on_weight=lambda name, w: seen.setdefault(name, w.detach().clone()),
    )
    exported = read_hf_tensors(export_hf(q, q + "-hf", progress=False))
    dense = [n for n in seen if n.endswith(".weight")]
    experts = [n for n in seen if n.endswith(".w13")]
    assert dense and experts and len(seen) == len(dense) + 2 * len(experts)
    run_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    for name in dense:
        assert seen[name].dtype == run_dtype
        assert torch.equal(dequantized(exported, name[: -len(".weight")]).to(run_dtype), seen[name]), name
    for name in experts:
        module = name[: -len(".w13")]
        w13, w2 = seen[name], seen[module + ".w2"]
        for e in range(w13.shape[0]):
            gate_up = torch.cat([dequantized(exported, f"{module}.{e}.{p}") for p in ("gate_proj", "up_proj")])
            assert torch.equal(gate_up.to(run_dtype), w13[e]), (name, e)
            assert torch.equal(dequantized(exported, f"{module}.{e}.down_proj").to(run_dtype), w2[e]), (name, e)


def whole_model_report(ck: str, q: str, eval_ids: torch.Tensor):
    """The numbers computed directly: the whole model unquantized, and fake-quantized with the
    calibrated checkpoint's record (eprt.quant.preview), over the held-out ids at once."""
    ref_model = load_model(ck, dtype=torch.float32)
    q_model, _, cal, _ = fake_quantized_model(ck, q, torch.float32)
    # the keys and values attention consumes are on the FP8 grid of the export's k/v scales
    kv = []
    for name, attn in q_model.named_modules():
        if name in cal.kv_amax:
            scales = [fp8_scale(a) for a in cal.kv_amax[name]]
            attn.taps.replace = lambda k, v, quant=attn.taps.replace, s=scales: kv.append((quant(k, v), s)) or kv[-1][0]
    outs = {}
    for tag, model in (("ref", ref_model), ("q", q_model)):
        for i, layer in enumerate(model.model.layers):
            layer.register_forward_hook(lambda _m, _a, y, i=i, tag=tag: outs.__setitem__((tag, i), y))
    with torch.inference_mode():
        logp_ref = torch.log_softmax(ref_model(eval_ids).float(), -1)
        logp_q = torch.log_softmax(q_model(eval_ids).float(), -1)
    assert len(kv) == len(cal.kv_amax) > 0
    for pair, scales in kv:
        for x, scale in zip(pair, scales):
            assert not torch.equal(x, torch.zeros_like(x)) and torch.equal(fake_quant_fp8(x, scale), x)
    kl = (logp_ref.exp() * (logp_ref - logp_q)).sum(-1).double().flatten()
    nll = lambda logp: -logp[:, :-1].gather(-1, eval_ids[:, 1:, None]).double().mean()  # noqa: E731
    layers = [
        ((outs["q", i] - outs["ref", i]).double().norm() / outs["ref", i].double().norm()).item()
        for i in range(len(ref_model.model.layers))
    ]
    return {
        "kl_mean": kl.mean().item(),
        "kl_p99": torch.quantile(kl, 0.99).item(),
        "top1_agreement": (logp_ref.argmax(-1) == logp_q.argmax(-1)).double().mean().item(),
        "ppl": (math.exp(nll(logp_ref)), math.exp(nll(logp_q))),
        "layers": layers,
    }


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_numbers_are_the_whole_models(ckpts, tmp_path, family):
    ck, q = ckpts[family], str(tmp_path / "q")
    report = run_ptq(ParallelState.single("cpu"), args(ck, q))["quality"]
    with Checkpoint(ck) as c:
        calib, eval_ids = held_out_samples(
            None, c.hf_files_dir(), num_samples=CALIB, held_out=EVAL, seq_len=SEQ_LEN, vocab_size=c.config.vocab_size
        )
    want = whole_model_report(ck, q, eval_ids)
    assert report["eval"]["tokens"] == EVAL * SEQ_LEN
    assert "router_flips" not in report  # AWQ's alone: the other algorithms' reports keep their bytes
    assert report["kl_mean"] > 0  # the quantization changes something, or the test would prove nothing
    for key in ("kl_mean", "kl_p99"):
        assert report[key] == pytest.approx(want[key], rel=1e-3), key
    assert report["top1_agreement"] == pytest.approx(want["top1_agreement"], abs=1.5 / (EVAL * SEQ_LEN))
    ppl = report["perplexity"]
    assert (ppl["unquantized"], ppl["quantized"]) == pytest.approx(want["ppl"], rel=1e-5)
    assert [layer["relative_error"] for layer in report["layers"]] == pytest.approx(want["layers"], rel=1e-3)
    for layer in report["layers"]:
        assert 0 < len(layer["top"]) <= 5
        assert all(t["module"].startswith(f"model.layers.{layer['layer']}.") for t in layer["top"])


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def calibrate_logged(state, ck, out, **kw):
    """The report, and the lines it printed at INFO (which a command sets up; here, the test)."""
    lines, log = Lines(), logger()
    level = log.level
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    try:
        report = run_ptq(state, args(ck, out, **kw))["quality"]
    finally:
        log.removeHandler(lines)
        log.setLevel(level)
    return report, [line for line in lines.lines if "quality on" in line or line.startswith("  layer ")]


def world_two(ck, out):
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        return calibrate_logged(state, ck, out, batch_size=3)


def test_the_report_is_saved_exported_printed_and_the_same_at_every_layout(ckpts, tmp_path):
    ck = ckpts["qwen3_moe"]
    one = str(tmp_path / "one")
    report, printed = calibrate_logged(ParallelState.single("cpu"), ck, one)
    assert len(printed) == 1 + len(report["layers"]) and "top-1 agreement" in printed[0]
    manifest = json.loads(Path(one, MANIFEST).read_text())
    assert manifest["quantization"]["quality"] == QUALITY_FILE
    assert json.loads(Path(one, QUALITY_FILE).read_text()) == report
    out = export_hf(one, one + "-hf", progress=False)
    assert Path(out, QUALITY).read_bytes() == Path(one, QUALITY_FILE).read_bytes()
    assert check_export(out) == []

    (rank0, printed0), (rank1, printed1) = run_world(world_two, 2, ck, str(tmp_path / "two"), timeout=120)
    assert printed0 == printed and printed1 == []  # rank 0 prints, the others do not
    assert rank0 == rank1 == report  # every number summed per sequence or work unit, then in order


def test_the_expert_probes_make_their_reference_a_part_of_the_experts_at_a_time(ckpts, tmp_path, monkeypatch):
    """A step holds one part's reference rows, not the step's: the same report in any parts."""
    ck, made = ckpts["qwen3_moe"], []
    monkeypatch.setattr(quality, "expert_parts", lambda rows, n: made.append(found := expert_parts(rows, n)) or found)
    report = run_ptq(ParallelState.single("cpu"), args(ck, str(tmp_path / "parts")))["quality"]
    assert made and all(len(parts) > 1 for parts in made)
    monkeypatch.setattr(quality, "REFERENCE_PARTS", 1)
    assert run_ptq(ParallelState.single("cpu"), args(ck, str(tmp_path / "whole")))["quality"] == report


@pytest.mark.parametrize("rows", [[5, 0, 3, 9, 1, 0, 0, 2], [0, 0, 7], [1] * 20, [40, 1, 1, 1], [0, 0]])
def test_expert_parts_take_every_expert_in_order_each_part_within_its_share(rows):
    parts = expert_parts(rows, 4)
    share = math.ceil(sum(rows) / 4)
    assert [e for e0, e1 in parts for e in range(e0, e1)] == list(range(len(rows)))[: parts[-1][1] if parts else 0]
    assert sum(rows[parts[-1][1] :] if parts else rows) == 0  # only experts without rows are left out
    assert all(sum(rows[e0:e1]) < share + max(rows[e0:e1]) for e0, e1 in parts)


def test_eval_size_0_writes_no_report_and_eval_reads_its_own_file(ckpts, tmp_path):
    ck = ckpts["qwen3_moe"]
    off = str(tmp_path / "off")
    assert run_ptq(ParallelState.single("cpu"), args(ck, off, eval_size=0))["quality"] is None
    assert not os.path.exists(Path(off, QUALITY_FILE))
    assert "quality" not in json.loads(Path(off, MANIFEST).read_text())["quantization"]
    assert not os.path.exists(Path(export_hf(off, off + "-hf", progress=False), QUALITY))

    ids = str(tmp_path / "eval.npy")
    np.save(ids, np.arange(3 * SEQ_LEN) % 500)
    report = run_ptq(ParallelState.single("cpu"), args(ck, str(tmp_path / "file"), eval=ids, eval_size=3))["quality"]
    assert report["eval"] == {"sequences": 3, "seq_len": SEQ_LEN, "tokens": 3 * SEQ_LEN, "data": ids}


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"eval_size": -1}, "--eval-size -1: give a positive size, or 0"),
        ({"eval": "missing.npy"}, "--eval missing.npy: no such file"),
        ({"eval": "x.npy", "eval_size": 0}, "--eval x.npy with --eval-size 0"),
    ],
)
def test_bad_report_settings_are_refused_by_name(ckpts, tmp_path, kw, message):
    with pytest.raises(RankFailure, match=re.escape(message)):
        run_ptq(ParallelState.single("cpu"), args(ckpts["qwen3_moe"], str(tmp_path / "q"), **kw))
    assert not os.path.exists(tmp_path / "q")


def in_reverse(pieces, buffers, body, device):
    """eprt.kernels.cpu_workers.for_each with the pieces run last first, on the calling thread."""
    bufs = buffers()
    for piece in reversed(list(pieces)):
        body(piece, bufs)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_the_sequences_dense_parts_run_in_any_order(ckpts, tmp_path, monkeypatch, family):
    """The engine runs a step's sequences' dense parts side by side: whatever order they come in,
    the calibration (amax, GPTQ's Hessians and codes) and the report (its probes' calls filed per
    sequence) are the same bytes."""

    def calibrate(out):
        run_ptq(
            ParallelState.single("cpu"), args(ckpts[family], out, algorithm="gptq", gptq_min_tokens=1, chunk_size=CALIB)
        )
        return {p.name: p.read_bytes() for p in Path(out).iterdir()}

    as_they_come = calibrate(str(tmp_path / "threads"))
    monkeypatch.setattr("eprt.quant.loop.engine.for_each", in_reverse)
    assert calibrate(str(tmp_path / "reversed")) == as_they_come


def test_a_probes_calls_are_filed_under_the_sequence_each_thread_runs():
    """Two threads run two sequences through a probed Linear, the second thread's call landing
    while the first is inside its sequence: each call is filed under its own sequence."""
    torch.manual_seed(0)
    mlp = GatedMLP(8, 16)
    for p in mlp.parameters():
        p.data.normal_()
    x = torch.randn(2, 5, 8)
    probes = Probes(mlp, "mlp.", ["mlp.up_proj"], num_units=1)
    errors = probes.errors
    reference = mlp.up_proj.weight.detach().clone()
    mlp.up_proj.weight.data.mul_(1.5)  # as fake quantization replaces it
    entered, called = threading.Event(), threading.Event()

    def first():
        errors.enter(0)
        entered.set()
        called.wait()  # the other thread's call comes while this one is inside sequence 0
        mlp(x[0])

    def second():
        entered.wait()
        errors.enter(1)
        mlp(x[1])
        called.set()

    threads = [threading.Thread(target=f) for f in (first, second)]
    with probes.measuring():
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(errors.dense["mlp.up_proj"]) == [0, 1]
    for s in (0, 1):
        y_ref = x[s] @ reference.T
        expected = torch.stack(
            [
                (0.5 * y_ref).double().square().sum(),
                y_ref.double().square().sum(),
                torch.tensor(5.0, dtype=torch.float64),
            ]
        )
        [got] = errors.dense["mlp.up_proj"][s]
        torch.testing.assert_close(got, expected)


def test_awq_reports_the_router_choices_its_folds_change(ckpts, tmp_path, monkeypatch):
    """With AWQ, each MoE layer's router choices on the held-out tokens, the original layer's
    against the folded (unquantized) layer's on the same input, counted as the model itself
    computes them; their share in the JSON and on the page. A bf16 router's choices move with
    the folds' roundings: the search is made to choose its last candidate (the widest scales)
    everywhere, so that some do on this small model."""
    last_wins = lambda _st, errors, _units, _over: -torch.arange(errors.shape[-1]).expand(errors.shape[1:])  # noqa: E731
    monkeypatch.setattr(awq_pass, "exact_totals", last_wins)
    ck, q = ckpts["qwen3_moe"], str(tmp_path / "q")
    report = run_ptq(ParallelState.single("cpu"), args(ck, q, dtype="bf16", algorithm="awq"))["quality"]
    with Checkpoint(ck) as c, Checkpoint(q) as calibrated:
        _, eval_ids = held_out_samples(
            None, c.hf_files_dir(), num_samples=CALIB, held_out=EVAL, seq_len=SEQ_LEN, vocab_size=c.config.vocab_size
        )
        K = c.config.num_experts_per_tok
        original = load_model(ck, dtype=torch.bfloat16)
        folds = CalibrationRecord.read(calibrated).parts["awq"]
        folded = load_parallel(
            ResolvedCheckpoint.of(FoldedCheckpoint(c, folds), torch.bfloat16), ParallelState.single()
        )
    inputs, choices = {}, {}
    for tag, model in (("original", original), ("folded", folded)):
        for i, layer in enumerate(model.model.layers):
            if layer.routed is not None:
                if tag == "original":
                    layer.register_forward_pre_hook(lambda _m, a, i=i: inputs.__setitem__(i, a[0]))
                else:  # the original layer's input, through the folded layer
                    layer.register_forward_pre_hook(lambda _m, a, i=i: (inputs[i], *a[1:]))
                hook = lambda _m, _a, out, key=(tag, i): choices.__setitem__(key, out[0])  # noqa: E731
                layer.routed.gate.register_forward_hook(hook)
    with torch.inference_mode():
        original(eval_ids)
        folded(eval_ids)
    want = {}
    for (tag, i), ids in choices.items():
        if tag == "original":
            kept = (ids.unsqueeze(-1) == choices["folded", i].unsqueeze(-2)).any(-1)
            want[i] = {"changed": int((~kept).sum()), "choices": EVAL * SEQ_LEN * K}
    got = {layer["layer"]: layer["router_flips"] for layer in report["layers"] if "router_flips" in layer}
    assert got == want and sum(w["changed"] for w in want.values()) > 0
    share = sum(w["changed"] for w in want.values()) / sum(w["choices"] for w in want.values())
    assert report["router_flips"] == share
    page = Path(q, QUALITY_FILE).with_suffix(".html").read_text()
    assert f'data-key="router_flips" data-value="{share!r}"' in page


def test_a_run_calibrated_on_token_ids_writes_its_report_and_page(tmp_path):
    """Token ids hold no documents: their source records none (null), which the report's schema
    reads as such, so the run's report is read back and its export carries the page, as a text
    source's does."""
    ck = convert_hf(make_tiny("qwen3_moe", str(tmp_path / "hf")), str(tmp_path / "ck"), progress=False)
    ids = tmp_path / "ids.npy"
    np.save(ids, np.random.default_rng(0).integers(0, 512, size=(8, 24)))
    out = tmp_path / "q"
    args = PTQArgs(ck, "fp8", str(out), calib=str(ids), calib_size=4, seq_len=24, eval_size=2, progress=False)
    report = run_ptq(ParallelState.single("cpu"), args)["quality"]
    assert [s["documents"] for s in report["calibration"]["sources"]] == [None]
    assert read_report_json(json.loads(Path(out, QUALITY_FILE).read_text()))["calibration"]["sources"][0]["tokens"] > 0
    assert Path(export_hf(str(out), str(tmp_path / "export"), progress=False), QUALITY_PAGE).is_file()
