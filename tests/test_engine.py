"""The layer-major engine against the whole-model forward, its schedule, and its work units."""

import contextlib

import pytest
import torch

from eprt import families
from eprt.families import reader_for
from eprt.hf.convert import convert_hf
from eprt.kernels.grouped_gemm import grouped_mm_loop, unit_mlp
from eprt.loading.loader import load_model
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.models.layers import silu_mul
from eprt.parallel import ParallelState
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerEngine, Pass
from eprt.quant.loop.passes import layer_passes
from eprt.quant.loop.sequences import Schedule, own_sequences
from eprt.storage.checkpoint import Checkpoint
from eprt.testing.tiny import make_tiny

# every family of the table: a new one gets the engine's per-layer hooks or fails here
FAMILIES = [f.name for f in families.FAMILIES]


@pytest.fixture(scope="module", params=FAMILIES)
def ckpt(request, tmp_path_factory):
    d = tmp_path_factory.mktemp(request.param)
    return convert_hf(make_tiny(request.param, str(d / "hf"), dtype="fp32"), str(d / "ck"), progress=False)


def targets(ck_dir: str) -> list[str]:
    with Checkpoint(ck_dir) as ck:
        return reader_for(ck.config.model_type, ck_dir).layout(ck.config).linear_modules()


def test_the_engine_records_what_the_whole_model_forward_records(ckpt):
    """Every quantized Linear's input amax, every expert's amax and token count and the KV amax,
    layer by layer as in one forward of the whole model (fp32: the kernels differ in the last bits only)."""
    samples = torch.randint(0, 200, (5, 12), generator=torch.Generator().manual_seed(0))
    names = targets(ckpt)
    model = load_model(ckpt, dtype=torch.float32)
    whole = Calibrator(model, names, kv=True)
    with torch.inference_mode():
        model(samples)
    layered = Calibrator(None, names, kv=True)
    with Checkpoint(ckpt) as ck, torch.inference_mode():
        engine = LayerEngine(
            ParallelState.single("cpu"),
            ResolvedCheckpoint.of(ck, torch.float32),
            samples,
            layer_passes(layered),
            schedule=Schedule.of(5, 12, 2, group_tokens=24),
            progress=False,
        )
        engine.run(0, engine.embed())
    assert layered.input_amax.keys() == whole.input_amax.keys() and whole.input_amax
    for name, amax in whole.input_amax.items():
        torch.testing.assert_close(layered.input_amax[name], amax, rtol=1e-5, atol=0, msg=name)
    assert layered.kv_amax.keys() == whole.kv_amax.keys()
    for name, (k, v) in whole.kv_amax.items():
        torch.testing.assert_close(torch.stack(layered.kv_amax[name]), torch.stack([k, v]), rtol=1e-5, atol=0)
    assert layered.expert_amax.keys() == whole.expert_amax.keys() and whole.expert_amax
    for name, pair in whole.expert_amax.items():
        torch.testing.assert_close(torch.stack(layered.expert_amax[name]), torch.stack(pair), rtol=1e-5, atol=0)
        assert torch.equal(layered.expert_tokens[name], whole.expert_tokens[name]), name


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_every_layout_calibrates_each_sequence_on_exactly_one_rank(world):
    shares = [own_sequences(7, r, world) for r in range(world)]
    assert sorted(s for share in shares for s in share) == list(range(7))


def test_a_schedule_steps_over_whole_groups():
    s = Schedule.of(num_sequences=11, seq_len=8, step_sequences=5, group_tokens=16)
    assert (s.group_size, s.groups_per_step, s.num_groups, s.num_steps) == (2, 3, 6, 2)
    assert [list(s.step_sequences(i)) for i in range(s.num_steps)] == [list(range(6)), list(range(6, 11))]
    # a group is never cut by a step, whatever the step size asked for
    for step in range(1, 12):
        t = Schedule.of(11, 8, step, group_tokens=16)
        firsts = [t.step_sequences(i).start for i in range(t.num_steps)]
        assert all(f % 2 == 0 for f in firsts) and sum(len(t.step_sequences(i)) for i in range(t.num_steps)) == 11


def test_a_work_unit_computes_as_if_alone():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(23, 16, generator=g)
    w13, w2 = torch.randn(3, 2 * 8, 16, generator=g), torch.randn(3, 16, 8, generator=g)
    counts = torch.tensor([[4, 0, 3], [0, 0, 0], [9, 6, 1]])
    h, y = unit_mlp(x, w13, w2, silu_mul, counts)
    offsets = torch.cumsum(counts.sum(1), 0, dtype=torch.int32)
    h_ref = silu_mul(*grouped_mm_loop(x, w13, offsets).chunk(2, dim=-1))
    torch.testing.assert_close(h, h_ref)
    torch.testing.assert_close(y, grouped_mm_loop(h_ref, w2, offsets))
    # a unit's bits are those of its rows alone, wherever the unit sits in the call
    for a, b, e in ((4, 7, 0), (7, 16, 2), (16, 22, 2)):
        h_alone, y_alone = unit_mlp(x[a:b].clone(), w13[e : e + 1], w2[e : e + 1], silu_mul, torch.tensor([[b - a]]))
        assert torch.equal(h[a:b], h_alone) and torch.equal(y[a:b], y_alone), (a, b)


class Recording(Pass):
    """A pass that changes nothing and records when each hook runs."""

    def __init__(self):
        self.calls = []

    def begin(self, embed):
        self.calls.append(("begin",))

    @contextlib.contextmanager
    def observe(self, layer):
        self.calls.append(("observe", layer.index))
        yield
        self.calls.append(("observed", layer.index))

    def on_routed(self, layer, routed):
        if self.calls[-1] != ("routed", layer.index):
            self.calls.append(("routed", layer.index))

    def reference(self, layer):
        self.calls.append(("reference", layer.index))

    def quantize(self, layer):
        self.calls.append(("quantize", layer.index))

    def on_quantized(self, layer):
        self.calls.append(("on_quantized", layer.index))

    def finish(self, engine, ls):
        self.calls.append(("finish",))


def test_a_pass_sees_each_layer_through_its_hooks_in_order_and_changes_nothing_it_does_not_touch(tmp_path):
    """An algorithm added as a pass: registered beside the others, its hooks run on every layer in
    order (the routed steps between the statistics run's taps), and the hidden states are those of
    a run without it."""
    ck_dir = convert_hf(
        make_tiny("qwen3_moe", str(tmp_path / "hf"), dtype="fp32"), str(tmp_path / "ck"), progress=False
    )
    samples = torch.randint(0, 200, (3, 8), generator=torch.Generator().manual_seed(0))
    outs, recording = [], Recording()
    with Checkpoint(ck_dir) as ck, torch.inference_mode():
        for extra in ([], [recording]):
            engine = LayerEngine(
                ParallelState.single("cpu"),
                ResolvedCheckpoint.of(ck, torch.float32),
                samples,
                layer_passes(Calibrator(None, targets(ck_dir), kv=True)) + extra,
                schedule=Schedule.of(3, 8, 2, group_tokens=8),
                progress=False,
            )
            outs.append(engine.run(0, engine.embed()).hidden)
        layers = range(ck.config.num_layers)
    assert torch.equal(*outs)
    moe = {i for i in layers if i in ck.config.moe_layers}
    assert moe and moe != set(layers)  # both kinds of layer seen
    expected = [("begin",)]
    for i in layers:
        expected += [
            ("observe", i),
            *([("routed", i)] if i in moe else []),
            ("observed", i),
            ("reference", i),
            ("quantize", i),
            ("on_quantized", i),
        ]
    assert recording.calls == [*expected, ("finish",)]
