"""How long a calibration will take, from its schedule and a short probe on the device it will use.

A run's time is, for each kind of layer (dense-MLP or MoE decoder layers, each attention kind apart, and
the MTP layers), the layers of that kind x (the steps each runs x one step's time + what a layer does
besides its steps: GPTQ's solve, the quality report's held-out runs). The steps are the progress bar's:
the schedule's steps x the runs of the calibration sequences each layer takes (the statistics run, and
with GPTQ its Hessian run and the run through the quantized layer).

The probe times them: for the first layer of each kind, this rank's share of that layer is read as
the run reads it (from the checkpoint, source encodings decoded, copied to the device: the layer's read
time, from this first, cold read), then its weights are set at random (the checkpoint's bytes are read
again only where the run itself reads them again: GPTQ's and the scales' original weights), and it runs
through the run's own program's passes (eprt.quant.algorithms.program) over PROBE_STEPS steps of this rank's share
(eprt.quant.run.probe_share: its routed experts, its sequences of a step; a run of fewer steps probed whole, so
what a layer does once over all its sequences, AWQ's search, is timed over the run's count), once to warm up (kernels
compiled, caches made) and once timed. Within each run of the timed layer the steps after its first give
the step time; the rest of the layer's time is its own, but for what a pass does once over every
calibration sequence (Pass.per_sequence_work: AWQ's search), timed apart and scaled from the probe's
sequences to the rank's in the run. The token exchange between the ranks, which a
single process does not make, is timed apart: the bytes one step sends each way, by the same
collectives, on the run's own process group. Saving a layer boundary to the work directory
(eprt.quant.run.workdir) is timed by writing the probe's hidden states there, durably, and counted at the
run's rate of saves (--save-every), less the time of the next layer, which computes while a save is written. What the estimate leaves out: after the last layer the quality
report's head, and the output's writing.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch

from eprt.loading.resolved import ResolvedCheckpoint
from eprt.parallel import ParallelState
from eprt.quant.algorithms.program import Program
from eprt.quant.algorithms.registry import option_default, option_flags, run_options
from eprt.quant.loop.calibrate import Calibrator
from eprt.quant.loop.engine import LayerEngine, cpu_threads
from eprt.quant.loop.passes.mtp import MTPLayers
from eprt.quant.loop.passes.quality import QualityStreams
from eprt.quant.loop.sequences import LayerState
from eprt.quant.quality import QualityReport
from eprt.quant.run.memory_plan import RunShape
from eprt.quant.run.probe_share import RankShare
from eprt.quant.run.save_time import save_seconds, saves

PROBE_STEPS = 3  # steps of each probe run: the first pays for what the run before it left, the others are timed
EXCHANGE_REPEATS = 3  # timed exchanges of one step's bytes, after one to warm up


@dataclass(frozen=True)
class LayerKind:
    """Decoder layers of one structure: the same tensors, so the same time."""

    name: str  # "MoE", "dense-MLP"; with the first layer's index where two kinds share it
    layers: tuple[int, ...]  # decoder layer indices; for the MTP layers, 0 to k - 1 (the k-th MTP layer)
    steps: int  # counted calibration steps per layer (the progress bar's)
    moe: bool


@dataclass(frozen=True)
class KindTime:
    kind: LayerKind
    step_s: float  # one counted step on one rank
    layer_s: float  # one layer's work besides its steps, on one rank
    read_s: float = 0.0  # reading this rank's share of one layer: from disk, decoded, to the device
    # one layer's own work that grows with the calibration sequences (Pass.per_sequence_work: AWQ's
    # search), at the run's count of this rank's sequences
    sequences_s: float = 0.0

    @property
    def seconds(self) -> float:
        return len(self.kind.layers) * (self.kind.steps * self.step_s + self.layer_s + self.read_s + self.sequences_s)


@dataclass(frozen=True)
class TimeEstimate:
    device: str
    kinds: tuple[KindTime, ...]
    exchange_s: float = 0.0  # one counted step's token exchange, on a world of several ranks
    exchange_steps: int = 0  # the counted steps that exchange tokens (those of MoE layers)
    save_s: float | None = None  # one save of a layer boundary to the work directory; None: not measured
    saves: int = 0  # the saves the run makes (eprt.quant.run.save_time.saves)

    @property
    def saving_s(self) -> float:
        """The time the run waits on its saves: a save is written while the next layer computes, so of
        each only what outlasts a layer (of the quickest kind) counts, and of the last, which no layer
        follows, all of it."""
        if not self.saves or self.save_s is None:
            return 0.0
        layer_s = min(k.seconds / len(k.kind.layers) for k in self.kinds)
        return self.save_s + (self.saves - 1) * max(0.0, self.save_s - layer_s)

    @property
    def seconds(self) -> float:
        return sum(k.seconds for k in self.kinds) + self.exchange_steps * self.exchange_s + self.saving_s

    def summary(self) -> str:
        """'about 12 min 30 s (its terms)': the dry run prints it."""
        terms = [
            f"{len(k.kind.layers)} {k.kind.name} x ({k.kind.steps} steps x {k.step_s:.3g} s + {k.layer_s:.3g} s"
            + (f" + over the sequences {k.sequences_s:.3g} s" if k.sequences_s else "")
            + f" + reading {k.read_s:.3g} s)"
            for k in self.kinds
        ]
        if self.exchange_steps:
            terms.append(f"token exchange {self.exchange_steps} steps x {self.exchange_s:.3g} s")
        if self.save_s is not None:
            terms.append(
                f"work directory {self.saves} saves x {self.save_s:.3g} s, written while the next layer "
                f"computes: {self.saving_s:.3g} s waited"
            )
        elif self.saves:
            terms.append(f"{self.saves} saves to the work directory not counted (no --work-dir or --out given)")
        return f"about {format_seconds(self.seconds)} ({', '.join(terms)})"


def format_seconds(s: float) -> str:
    """'83.2 s', with the minutes or hours beside from a minute on: '4520.0 s (1 h 15 min)'."""
    minutes = round(s / 60)
    if minutes < 1:
        return f"{s:.1f} s"
    return f"{s:.1f} s ({minutes} min)" if minutes < 60 else f"{s:.1f} s ({minutes // 60} h {minutes % 60:02d} min)"


def layer_kinds(engine: LayerEngine, mtp_runs: int) -> list[LayerKind]:
    """The run's kinds of decoder layers in order of their first layer, each with its counted steps,
    then the MTP layers the run calibrates (`mtp_runs`: the calibration runs each takes) as one kind."""
    by_structure: dict[frozenset, list[int]] = {}
    for i, layer in enumerate(engine.decoder.layers):
        structure = frozenset((n, tuple(t.shape)) for n, t in layer.state_dict().items())
        by_structure.setdefault(structure, []).append(i)
    moe = [engine.decoder.layers[ls[0]].routed is not None for ls in by_structure.values()]
    names = ["MoE" if m else "dense-MLP" for m in moe]
    kinds = [
        LayerKind(
            name if names.count(name) == 1 else f"{name} (as layer {ls[0]})", tuple(ls), engine.steps_per_layer, m
        )
        for name, ls, m in zip(names, by_structure.values(), moe)
    ]
    mtp = next(p for p in engine.passes if isinstance(p, MTPLayers)).prefixes(engine)
    if mtp:
        steps = engine.calibration.schedule.num_steps * mtp_runs
        kinds.append(LayerKind("MTP", tuple(range(len(mtp))), steps, True))
    return kinds


class ProbeEngine(LayerEngine):
    """The engine over one rank's share (`share`) of each layer, read as the run reads it (each read's
    seconds in `read_s`), then set at random; its per-layer log lines are the probe's own, not shown."""

    def __init__(self, *args, share: RankShare, **kw):
        self.share = share
        super().__init__(*args, **kw)
        self.log = logging.getLogger("eprt.probe")
        self.log.disabled = True
        self.read_s: list[float] = []

    def experts_held(self, state: ParallelState, num_experts: int) -> tuple[int, int]:
        return self.share.held(num_experts)

    def _assign(self, prefix: str) -> int:
        start = time.perf_counter()
        placed = super()._assign(prefix)
        if self.state.device.type == "cuda":
            torch.cuda.synchronize(self.state.device)
        self.read_s.append(time.perf_counter() - start)
        for name in (n for n in self.names if n.startswith(prefix)):
            module, _, attr = name.rpartition(".")
            random_like(getattr(self.model.get_submodule(module), attr))
        return placed


def random_like(t: torch.Tensor) -> None:
    """Fill `t` as a trained layer's weights look to the kernels: matrices of unit gain (activations stay
    of order one: no overflow, no subnormal arithmetic), vectors (norms, biases) of ones, integers zero."""
    if not t.is_floating_point():
        t.zero_()
    elif t.dim() >= 2:
        t.normal_(0.0, t.shape[-1] ** -0.5)
    else:
        t.fill_(1.0)


class StepClock:
    """The progress bar as the probe sees it: the time of each counted step."""

    def __init__(self):
        self.ticks: list[float] = []

    def set_postfix_str(self, *_, **__) -> None:
        pass

    def update(self, n: int = 1) -> None:
        self.ticks += [time.perf_counter()] * n


def probe_time(
    rc: ResolvedCheckpoint, device: torch.device, program: Program, shape: RunShape, *, expert_stack: int
) -> TimeEstimate:
    """The calibration's time on one rank of `shape` (without the token exchange and the saves),
    measured on `device` with the passes of `program` (the run's: eprt.quant.algorithms.program), on
    that rank's share alone."""
    state = ParallelState.single(device)
    share = RankShare(shape, PROBE_STEPS)
    T, D, K = shape.seq_len, rc.ck.config.hidden_size, rc.ck.config.num_experts_per_tok
    schedule = shape.schedule
    recipe, targets = program.recipe, list(program.targets)
    cal = Calibrator(None, targets, kv=recipe.kv_cache is not None, all_experts=shape.all_experts)
    quality = None
    if shape.eval_sequences:
        eval_ids = torch.zeros(share.eval_sequences, T, dtype=torch.int64)
        report = QualityReport(state, rc.ck, recipe, targets, eval_ids, "the probe's")
        quality = QualityStreams(state, report, share.eval_schedule)
        quality.sequences = share.sequences(state, share.eval_schedule, K)
    samples = torch.zeros(shape.num_sequences, T, dtype=torch.int64)
    options = run_options({field: option_default(field) for field in option_flags()}, probed=True)
    read_s: list[float] = []  # every probe engine's reads, in turn

    def fresh() -> ProbeEngine:
        """The program started afresh on this rank's share and its engine: what the warm-up decided
        (AWQ's folds) is not the timed run's to find already done."""
        run = program.start(rc, share.held(rc.ck.config.num_experts)[0])
        # every expert a probe step reaches is solved, as a run's many tokens reach them all
        run.begin(state, cal, tokens=shape.num_sequences * T, options=options, expert_stack=expert_stack)
        passes = run.passes(cal, quality=quality)
        engine = ProbeEngine(state, run.rc, samples, passes, schedule=schedule, progress=False, share=share)
        engine.read_s = read_s
        return engine

    engine = fresh()
    passes = engine.passes
    mtp_runs = 1 + sum(p.calibration_runs for p in passes if p.covers_mtp)
    kinds = layer_kinds(engine, mtp_runs)
    counted = engine.steps_per_layer // schedule.num_steps  # runs of the calibration sequences a layer takes
    probe = share.schedule  # at most PROBE_STEPS steps of this rank's share
    S = probe.num_steps

    def entering(n: int, snapshots: int = 0) -> LayerState:
        """A layer state of n random sequences: hidden states (and snapshots), and what the layers
        read of the tokens (eprt.models.decoder.Decoder.first_carried) of random token ids."""

        def hidden() -> torch.Tensor:
            return torch.randn(n, T, *rc.ck.config.streams_shape, D, dtype=rc.dtype, device=device)

        ids = torch.randint(rc.ck.config.vocab_size, (n, T), device=device)
        return LayerState(hidden(), [hidden() for _ in range(snapshots)], engine.decoder.first_carried(ids))

    if quality is not None:
        quality.begin(lambda ids: entering(ids.shape[0]))
    # the run's sequences on this rank over the probe's: what a layer does once over each is scaled by it
    scale = math.ceil(shape.num_sequences / shape.world) / probe.num_sequences
    times = {}
    with torch.inference_mode(), cpu_threads(device):
        decoder_kinds = [k for k in kinds if k.name != "MTP"]
        for kind in decoder_kinds:
            i = kind.layers[0]
            for _ in range(2):  # warm up (its read the cold one, the layer's first), then timed
                engine = fresh()
                engine.calibration = share.sequences(state, probe, K)
                clock = StepClock()
                per_sequence = timed_references(engine.passes, clock)
                ls = entering(probe.num_sequences, len(snapshots(rc, i)))
                start = time.perf_counter()
                engine.run_layer(i, ls, clock)
                total = time.perf_counter() - start
            cold_read_s = read_s[-2]
            runs = [clock.ticks[r * S : (r + 1) * S] for r in range(counted)]
            # one schedule step, every run; a probe of one step (a run of one) is all the layer's own time
            step_s = sum((run[-1] - run[0]) / (S - 1) for run in runs) if S > 1 else 0.0
            # the per-sequence work: its references' time less the counted steps they ran
            own = sum(max(0.0, seconds - ticks * step_s / counted) for seconds, ticks in per_sequence)
            layer_s = max(0.0, total - read_s[-1] - S * step_s - own)
            times[kind.name] = (step_s / counted, layer_s, cold_read_s, own * scale)
    out = [KindTime(k, *times[k.name]) for k in decoder_kinds]
    # an MTP layer is an MoE decoder layer with its input projection: timed as the first MoE kind
    moe_time = next((times[k.name] for k in decoder_kinds if k.moe), None)
    if moe_time and not any(p.per_sequence_work and p.covers_mtp for p in passes):
        moe_time = (*moe_time[:3], 0.0)
    out += [KindTime(k, *moe_time) for k in kinds if k.name == "MTP" and moe_time]
    return TimeEstimate(device.type, tuple(out))


def timed_references(passes: list, clock: StepClock) -> list[tuple[float, int]]:
    """The `reference` of each pass whose own work grows with the sequences (Pass.per_sequence_work),
    timed: each call's (seconds, the counted steps it ran), in the list returned."""
    out: list[tuple[float, int]] = []
    for p in (p for p in passes if p.per_sequence_work):

        def timed(layer, reference=p.reference) -> None:
            start, ticks = time.perf_counter(), len(clock.ticks)
            reference(layer)
            out.append((time.perf_counter() - start, len(clock.ticks) - ticks))

        p.reference = timed
    return out


def snapshots(rc: ResolvedCheckpoint, i: int) -> range:
    """The attention-residual block snapshots layer `i` reads (Kimi-K3's): one per block begun before it."""
    kl = rc.ck.config.kimi_linear
    return range(math.ceil(i / kl.attn_res_block_size) if kl and kl.attn_res_block_size else 0)


def exchange_time(state: ParallelState, rc: ResolvedCheckpoint, shape: RunShape) -> float:
    """One step's token exchange on this rank of `shape`, timed on the run's own process group: the
    collectives eprt.parallel.dispatch.UnitDispatcher makes, each rank sending the routed copies of its
    share of the step's tokens that leave it (their rows and int64 keys) and receiving their outputs
    back. 0 in a world of one. Every rank calls it alike."""
    c = rc.ck.config
    if state.world == 1 or not c.moe_layers:
        return 0.0
    schedule = shape.schedule
    step_tokens = min(schedule.groups_per_step * schedule.group_size, shape.num_sequences) * shape.seq_len
    copies = math.ceil(step_tokens / state.world) * c.num_experts_per_tok
    width = c.routed_width
    per_peer = math.ceil(copies / state.world)  # copies spread evenly over the owners, this rank's stay
    row = width * rc.dtype.itemsize
    sizes = (8, per_peer * row, per_peer * 8, per_peer * row)  # counts, rows, keys, outputs back
    buffers = [torch.empty(n * state.world, dtype=torch.uint8, device=state.device) for n in sizes]

    def exchange() -> None:
        for b in buffers:
            state.all_to_all_single(torch.empty_like(b), b)
        if state.device.type == "cuda":
            torch.cuda.synchronize(state.device)

    exchange()  # warm up: the connections made
    start = time.perf_counter()
    for _ in range(EXCHANGE_REPEATS):
        exchange()
    return (time.perf_counter() - start) / EXCHANGE_REPEATS


def estimate_time(
    state: ParallelState,
    rc: ResolvedCheckpoint,
    program: Program,
    shape: RunShape,
    *,
    expert_stack: int,
    save_every: int = 1,
    work_dir: str | None = None,
    save_bytes: int = 0,
) -> TimeEstimate:
    """The calibration's wall time on a rank of `shape` on this machine's device under `program`
    (the run's): the probe, run on every rank, the exchange's time per counted step of an MoE layer,
    and the run's saves of `save_bytes` every `save_every` layers, timed in `work_dir`'s file system
    (None: not timed). Every rank calls it alike."""
    estimate = probe_time(rc, state.device, program, shape, expert_stack=expert_stack)
    exchange = exchange_time(state, rc, shape)
    # the exchange is made on each of a layer's calibration runs (its counted steps)
    steps = sum(len(k.kind.layers) * k.kind.steps for k in estimate.kinds if k.kind.moe)
    count = saves(rc.ck.config.num_layers, save_every)
    save_s = None
    if count and work_dir is not None:
        share = RankShare(shape, PROBE_STEPS).schedule.num_sequences
        c = rc.ck.config
        sample = torch.randn(share, shape.seq_len, *c.streams_shape, c.hidden_size, dtype=rc.dtype, device=state.device)
        save_s = save_seconds(work_dir, sample, save_bytes)
    return TimeEstimate(estimate.device, estimate.kinds, exchange, steps if exchange else 0, save_s, count)
