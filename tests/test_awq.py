"""AWQ: its folds change no output before quantization (every family's groups hold every reader of
what they scale), its search prefers the scales that balance an outlier channel, and its export
is a plain checkpoint, the same bytes at every layout and after a resume."""

import os
from datetime import timedelta
from functools import partial

import pytest
import torch
from safetensors.torch import load_file

from eprt.hf.check_export import check_export
from eprt.hf.convert import convert_hf
from eprt.hf.export import export_hf
from eprt.loading.loader import load_parallel
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.models.layers import silu_mul
from eprt.parallel import ParallelState
from eprt.parallel.guard import RankFailure
from eprt.quant.algorithms.awq import search as awq_search
from eprt.quant.algorithms.awq.folds import COLUMNS, FoldedCheckpoint, Folds, fold
from eprt.quant.algorithms.awq.groups import layer_groups
from eprt.quant.algorithms.awq.plan import awq_bytes
from eprt.quant.algorithms.awq.search import (
    STEPS,
    Reader,
    candidates,
    exact_totals,
    fake_inputs,
    fake_weights,
    readers_errors,
    unit_errors,
)
from eprt.quant.algorithms.program import program_of
from eprt.quant.calibrated import DENSE_FILE, experts_file
from eprt.quant.formats import weight_format
from eprt.quant.loop.engine import LayerEngine
from eprt.quant.numerics import abs_amax
from eprt.quant.run.ptq import PTQArgs, run_ptq
from eprt.quant.run.setup import plan_recipe
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny
from tests.layouts.test_ptq import FAMILIES, GROUP_TOKENS, same_files
from tests.multiproc import free_port, run_world


def random_folds(model, seed: int = 0) -> Folds:
    """A fold of random scales (e^U(-1, 1)) into every group of every decoder layer of `model`."""
    g = torch.Generator().manual_seed(seed)
    folds = Folds()
    prefix, decoder = model.decoder()
    for i, layer in enumerate(decoder.layers):
        groups, _ = layer_groups(layer, f"{prefix}layers.{i}.")
        for group in groups:
            divided = model.get_submodule(group.divided[0])
            if group.per_expert:
                shape = (divided.num_experts, divided.w2.shape[2])
            else:
                shape = (divided.weight.shape[0],)
            s = torch.exp(torch.rand(shape, generator=g) * 2 - 1)
            folds.add(*group.divided, s)
            s = group.reader_scales(s)
            for m, kind in group.readers:
                folds.add(m, kind, s)
    return folds


def routed_logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The logits of `ids` and each MoE layer's top-k expert ids."""
    choices = []
    hooks = [b.gate.register_forward_hook(lambda _m, _a, out: choices.append(out[0])) for _, b in model.moe_blocks()]
    with torch.inference_mode():
        logits = model(ids)
    for h in hooks:
        h.remove()
    return logits, choices


# qwen3_5_moe and kimi_k25 hold qwen3_next's and deepseek_v3's layers
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("qwen3_5_moe", "kimi_k25")])
def test_folds_leave_the_model_computing_the_same(tmp_path, family):
    """Random scales folded into every group: the fp32 model computes what it did, so no reader of a
    scaled tensor is missing from its group (an unscaled reader would be off by up to e^1). A
    router's choice between experts of near-equal scores may flip on the last bits: such a token
    (and what attends to it) is left out of the comparison, and the flips must be rare."""
    ck_dir = convert_hf(make_tiny(family, str(tmp_path / "hf")), str(tmp_path / "ck"), dtype="fp32", progress=False)
    state = ParallelState.single()
    B, T = 2, 16
    ids = torch.randint(0, 500, (B, T), generator=torch.Generator().manual_seed(1))
    with Checkpoint(ck_dir) as ck:
        model = load_parallel(ResolvedCheckpoint.of(ck, torch.float32), state)
        folds = random_folds(model)
        folded = load_parallel(ResolvedCheckpoint.of(FoldedCheckpoint(ck, folds), torch.float32), state)
        assert_same_logits(model, folded, ids, family)
    assert folds.by_module, family  # every family has a group to balance


def assert_same_logits(model, changed, ids: torch.Tensor, what: str, tol: float = 2e-4) -> None:
    """`changed` computes `model`'s logits of `ids` [B, T] within `tol`, but where a router's choice
    between experts of near-equal scores flipped on the last bits: such a token (and what attends to
    it) is left out of the comparison, and the flips must be rare."""
    B, T = ids.shape
    original, before = routed_logits(model, ids)
    logits, after = routed_logits(changed, ids)
    flipped = torch.zeros(B, T, dtype=torch.bool)
    for a, b in zip(before, after):
        flipped |= (a.sort(-1).values != b.sort(-1).values).any(-1).view(B, T)
    assert flipped.float().mean() <= 0.1, (what, flipped)
    same = ~(flipped.int().cummax(1).values.bool())  # positions before a sequence's first flip
    torch.testing.assert_close(logits[same], original[same], rtol=tol, atol=tol)


def test_the_search_balances_an_outlier_channel():
    """A Linear whose input has a few large channels: scaling them up in the weight (AWQ's premise)
    quantizes it with less output error than the identity, in NVFP4 weights and inputs."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 64, generator=g)
    x[:, :4] *= 30
    w = torch.randn(32, 64, generator=g) * 0.05
    fmt = weight_format("nvfp4")
    ks = torch.arange(STEPS)
    scales = candidates(x.abs().mean(0).double(), ks)
    assert torch.equal(scales[0], torch.ones(64))  # k 0: the identity
    reader = Reader(fmt, w, fake_weights(fmt, w, COLUMNS, scales))
    errors = reader.errors(x, fake_inputs(fmt, x, scales, x.abs().amax(0)))
    losses = exact_totals(ParallelState.single(), errors[None], 1, "dp")
    best = int(torch.argmin(losses))
    assert best > 0 and losses[best] < 0.9 * losses[0], losses


@pytest.mark.parametrize("name", ["mxfp4", "mxfp8", "fp8_channel", "fp8_block"])
def test_candidates_quantized_in_one_call_are_each_what_it_is_alone(name):
    """Every candidate's weight, quantized in one call (no per-tensor scale, rows apart) or one at a
    time (FP8 block's blocks span rows), is the bits of that candidate folded and quantized alone."""
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(24, 128, generator=g) * torch.rand(128, generator=g) * 3).bfloat16()
    fmt = weight_format(name)
    scales = candidates(torch.rand(128, generator=g).double() + 0.01, torch.tensor([0, 3, 8, 13, 19]))
    got = fake_weights(fmt, w, COLUMNS, scales)
    alone = []
    for s in scales:
        q = fold([(COLUMNS, s)], w)
        alone.append(fmt.fake_quantize_weight(q, fmt.scale(abs_amax(q)), False, torch.float32).T)
    assert torch.equal(got, torch.stack(alone))


def test_references_kept_from_round_to_round_give_the_errors_made_afresh(monkeypatch):
    """The search keeps each reader's reference outputs on each unit from its first round: every
    later round's errors, over units that span several batches, are the bits made without them."""
    monkeypatch.setattr(awq_search, "BATCH_ELEMENTS", 3000)  # a few units a batch
    g = torch.Generator().manual_seed(2)
    units = [torch.randn(n, 32, generator=g).bfloat16() for n in (7, 20, 1, 13, 30, 4)]
    w = torch.randn(48, 32, generator=g) * 0.1  # a gated MLP's gate and up, 24 rows each
    down = torch.randn(16, 24, generator=g) * 0.1
    fmt, amax = weight_format("nvfp4"), torch.cat(units).float().abs().amax(0)
    x_mean = torch.cat(units).double().abs().mean(0)

    def reader(scales, gated):
        return Reader(fmt, w, fake_weights(fmt, w, COLUMNS, scales), down if gated else None, silu_mul)

    for gated in (False, True):
        refs, halves_refs = [None] * len(units), [[None] * 3, [None] * 3]
        for ks in ([0, 4, 8], [2, 6], [1, 3]):
            scales = candidates(x_mean, torch.tensor(ks))
            afresh = unit_errors(reader(scales, gated), units, scales, amax)
            kept = unit_errors(reader(scales, gated), units, scales, amax, refs=refs)
            assert all(torch.equal(a, b) for a, b in zip(kept, afresh, strict=True))
            # the same units as two readers' (the routed experts' gate and up), their references kept apart
            halves = [(partial(reader, scales, gated), units[:3]), (partial(reader, scales, gated), units[3:])]
            kept = readers_errors(halves, fmt, scales, amax, halves_refs)
            assert all(torch.equal(a, b) for a, b in zip(kept, afresh, strict=True))
        assert all(r is not None for r in refs)


# --- runs: DeepSeek-V3 (MLA, a dense first layer, shared experts, an fp32 router) -------------
def args(ck: str, out: str, algorithm: str, **kw) -> PTQArgs:
    return PTQArgs(
        ck,
        "nvfp4",
        out,
        kv_cache="fp8",
        calib_size=9,
        seq_len=24,
        group_tokens=GROUP_TOKENS,
        eval_size=3,
        algorithm=algorithm,
        gptq_min_tokens=1,
        progress=False,
        **kw,
    )


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the Hugging Face source, its checkpoint, its awq+gptq calibration in one process)."""
    root = tmp_path_factory.mktemp("awq")
    hf = make_tiny("deepseek_v3", str(root / "hf"))
    ck = convert_hf(hf, str(root / "ck"), progress=False)
    run_ptq(ParallelState.single(), args(ck, str(root / "w1"), "awq+gptq"))
    return root, hf, ck


def calibrate_at_world_2(ck: str, out: str, port: int) -> None:
    os.environ["MASTER_PORT"] = str(port)
    with ParallelState.from_env(ep=2, timeout=timedelta(seconds=60)) as state:
        run_ptq(state, args(ck, out, "awq+gptq", batch_size=3))


def test_awq_gptq_exports_a_plain_checkpoint_the_same_bytes_at_every_layout(run):
    root, hf, ck = run
    run_world(calibrate_at_world_2, 2, ck, str(root / "w2"), free_port(), timeout=600)
    exports = [export_hf(str(root / w), str(root / f"export-{w}"), progress=False) for w in ("w1", "w2")]
    # exactly the source's tensors, each quantized weight replaced by its scales: no pre_quant_scale
    assert check_export(exports[0], hf) == []
    assert same_files(*exports)
    with Checkpoint(str(root / "w1")) as q:  # the folds are AWQ's: each MoE layer's norm and experts, and clips
        folded = {n.rsplit(".", 1)[1] for n in q.names(role="calibration") if ".awq_" in n}
    scales = {"awq_norm", "awq_columns", "awq_rows", "awq_w13_columns", "awq_w13_up_rows", "awq_w2_columns"}
    assert folded == scales | {"awq_clip", "awq_w13_clip", "awq_w2_clip"}
    assert_clips_held_per_rank(str(root / "w1"), str(root / "w2"), ck)


def assert_clips_held_per_rank(whole: str, shared: str, ck: str) -> None:
    """The routed experts' clips of the run at ep 2 (`shared`): each rank's file holds its own
    experts' rows, together the single process's (`whole`), and the dense file none; the memory
    plan at ep 2 counts the dense clips and one rank's share, to the byte."""
    with Checkpoint(whole) as q:
        routed = {n: q.read(n) for n in q.names(role="calibration") if n.endswith(("_w13_clip", "_w2_clip"))}
        E = q.config.num_experts
    files = [load_file(os.path.join(shared, f)) for f in (DENSE_FILE, experts_file(0), experts_file(1))]
    clips = [{n: t for n, t in f.items() if n.endswith("_clip")} for f in files]
    assert set(clips[1]) == set(clips[2]) == set(routed) and not set(clips[0]) & set(routed) and clips[0]
    for n, steps in routed.items():
        assert clips[1][n].shape[0] == clips[2][n].shape[0] == E // 2
        assert torch.equal(torch.cat([clips[1][n], clips[2][n]]), steps)
    with Checkpoint(ck) as c:
        rc = ResolvedCheckpoint.of(c, torch.bfloat16)
        recipe, targets = plan_recipe(rc, "nvfp4", "fp8", "awq+gptq")
        planner = program_of(recipe, targets).planner(rc, torch.device("cpu"))
    awq = next(m for m in planner.algorithms if m.name == "awq")
    planned = awq_bytes(awq.layers, 0, 0, 24, 2, 2)[2]
    assert planned == sum(t.nbytes for f in clips[:2] for t in f.values())


def test_a_run_stopped_mid_layer_resumes_to_the_same_bytes(run, tmp_path, monkeypatch):
    root, _, ck = run
    out = str(tmp_path / "q")
    run_step = LayerEngine._run_step

    def failing(self, layer, step, ls, **kw):
        if layer is self.decoder.layers[2]:
            raise RuntimeError("stopped")
        return run_step(self, layer, step, ls, **kw)

    monkeypatch.setattr(LayerEngine, "_run_step", failing)
    with pytest.raises(RankFailure, match="stopped"):
        run_ptq(ParallelState.single(), args(ck, out, "awq+gptq"))
    assert_each_layer_saved_its_own_folds(out + ".work", str(root / "w1"), layers=2)
    monkeypatch.setattr(LayerEngine, "_run_step", run_step)
    assert run_ptq(ParallelState.single(), args(ck, out, "awq+gptq", resume=True))["resumed_after"] == 1
    # the same bytes: every fold of layers 0 and 1 came back from their awq files
    exports = [export_hf(d, d + "-hf", progress=False) for d in (out, str(root / "w1"))]
    assert same_files(*exports)


def assert_each_layer_saved_its_own_folds(work: str, whole: str, layers: int) -> None:
    """The work directory of a run stopped in layer `layers`: each completed layer's awq file holds
    the folds of that layer's modules, exactly those the run never stopped (`whole`) calibrated,
    and no other (none of an earlier layer's again); the layer file holds none."""
    rank = os.path.join(work, "rank-00000")
    with Checkpoint(whole) as q:
        folds = {n: q.read(n) for n in q.names(role="calibration") if ".awq_" in n}
    for i in range(layers):
        saved = load_file(os.path.join(rank, f"awq-{i:05d}.safetensors"))
        mine = {n: t for n, t in folds.items() if n.startswith(f"model.layers.{i}.")}
        assert set(saved) == set(mine) and mine, i
        assert all(torch.equal(saved[n], t) for n, t in mine.items()), i
    assert sorted(os.listdir(rank)) == [
        *(f"{k}-{i:05d}.safetensors" for k in ("awq", "gptq") for i in range(layers)),
        f"layer-{layers - 1:05d}.safetensors",
    ]
    assert not [n for n in load_file(os.path.join(rank, f"layer-{layers - 1:05d}.safetensors")) if ".awq_" in n]
