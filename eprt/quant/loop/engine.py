"""Layer-major calibration: one decoder layer resident at a time, taken through a list of passes.

Every rank holds the hidden states of its own calibration sequences (rank r: sequences r,
r + world, ...). For each decoder layer in order it reads that layer's dense weights and its own
routed experts, runs the layer over its sequences step by step, sends each routed token to the
rank computing its work unit and back, lets the passes record and change what they own, frees the
layer and goes on. Every weight byte is read once; a rank's peak is one layer's weights, the hidden
states and one step's exchange buffers.

Layout invariance comes from canonical work units, not from batch-invariant kernels: every
matmul sees rows that are a function of the model and the data alone.
- The dense part of a layer (its dense blocks: attention, linear attention, a dense MLP; its
  routed block's router and shared experts) runs one sequence a call: its rows are that
  sequence's tokens (a step's sequences side by side on CPU workers). The engine asks a layer
  only for its routed block (`DecoderLayer.routed`, the last, if any) and runs it as
  `before_routed`, the exchange, `after_routed` (eprt.models.decoder).
- A routed expert runs over the copies routed to it from one group of `group_size` consecutive
  global sequences (a constant of the model and the data: `group_tokens`), in (sequence,
  position, k) order, as one matmul (eprt.parallel.dispatch.UnitDispatcher).
- A token's top-k outputs are summed in k order, in fp32.
A step holds whole groups, so neither the world, ep, edp, batch nor chunk size changes a bit.

The passes (`Pass`; the run's list: eprt.quant.loop.passes.layer_passes) are what an algorithm adds.
Each hook is called on every pass, in list order, on every rank alike, for each layer:
1. `observe`: a context around the statistics run, the calibration sequences through the layer
   as it is (their output becomes the hidden states, unless a pass `rewrites` them); its taps see
   what they need, `on_routed` each step's routed tokens. On leaving it the statistics are final.
2. `reference`: the layer as it is, its statistics final (more runs of their own sequences).
3. `quantize`: the layer made, in place, what the export computes.
4. `on_quantized`: runs through the quantized layer.
`begin` comes before layer 0 (a pass's own sequences are embedded), `finish` after the last.
A pass runs its sequences through the layer with `LayerWork.run`, never by changing the engine.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn

from eprt.kernels.cpu_workers import cpu_workers, for_each
from eprt.loading.loader import checked_meta, load_mtp
from eprt.loading.resolved import ResolvedCheckpoint, place_tensors
from eprt.models.decoder import Carry, LayerContext
from eprt.models.moe import MoE
from eprt.parallel import ParallelState
from eprt.progress import bar, logger
from eprt.quant.loop.read_ahead import ReadAhead
from eprt.quant.loop.sequences import LayerState, RoutedStep, Schedule, Sequences


def cpu_threads(device: torch.device):
    """On CPU, torch's threads (OMP_NUM_THREADS; torchrun starts its ranks with 1) as workers
    that take whole pieces (a sequence's dense part, the experts of a matmul call), and every
    operation itself on one thread: the CPU's reductions (the norms' means) and the BLAS's small
    matmuls split their work by the thread count, and the last bits follow the split
    (eprt.kernels.cpu_workers)."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    return cpu_workers(torch.get_num_threads())


@dataclass
class Pending:
    """A sequence of a step between its dense part and its routed experts."""

    sequence: int  # global index
    local: int  # row in the hidden states
    context: LayerContext  # what the layer reads of the sequence besides its hidden state
    carry: Carry  # what the routed block's output joins (the layer's residual rule)
    moe_in_TD: torch.Tensor  # the routed block's MoE's input
    experts_in_TD: torch.Tensor  # what the routed experts read
    topk_ids_TK: torch.Tensor
    topk_weights_TK: torch.Tensor


def newly_carried(context: LayerContext, handed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What a layer left in `context.carried` (LayerContext) for the layers after it: the entries
    it set, not those it was `handed` [1, ...]."""
    return {k: v for k, v in context.carried.items() if handed.get(k) is not v}


def joined(left: dict[int, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """Each sequence's entries left by a layer's run (by local index, every sequence of the rank),
    as the rank's [n, ...] by name. A layer leaves an entry for every sequence or for none."""
    rows = [left[li] for li in range(len(left))]
    names = set(rows[0])
    assert all(set(r) == names for r in rows), "a layer left carried entries for some of its sequences only"
    return {k: torch.cat([r[k] for r in rows]) for k in names}


def _nothing(*_) -> None:
    return None


@dataclass
class LayerWork:
    """One layer in the loop as the passes see it: the module, the prefix of its modules' names,
    its index (None: a multi-token-prediction layer), and what the passes settle for its quantized
    form. `kept` holds what stays installed until the layer is done."""

    engine: LayerEngine
    module: nn.Module
    prefix: str
    index: int | None
    tick: Callable[[], None]  # one calibration step done (the progress bar)
    hidden: LayerState | None = None  # the calibration sequences at the layer's input, from the statistics run on
    exported: set[str] = field(default_factory=set)  # modules whose weights hold the export's (GPTQ's)
    on_weight: Callable[[str, torch.Tensor], None] | None = None  # sees each weight as quantized in place
    kept: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    ticks: int = 0

    @property
    def state(self) -> ParallelState:
        return self.engine.state

    def run(
        self,
        sequences: Sequences,
        ls: LayerState,
        *,
        write: bool = True,
        on_sequence: Callable[[int], None] = _nothing,
        on_step: Callable[[int], None] = _nothing,
        on_routed: Callable[[RoutedStep], None] = _nothing,
        tick: Callable[[], None] = _nothing,
    ) -> None:
        """`sequences` (at `ls`) through the layer, step by step; with `write`, each output replaces
        its sequence's hidden state (else the run only feeds the taps). `on_step(step)` before each
        step; `on_sequence(local index)` on the thread about to run that sequence's dense part."""
        layer = self.module
        # what the layer files from its input for the layers after it (attention residuals' snapshots)
        snapshots = [s.clone() for s in layer.snapshots(ls.hidden)] if write else []
        # what the layer leaves for the layers after it as it runs (LayerContext.carried), by
        # sequence: with `write`, it replaces what the sequences carried under those names
        left: dict[int, dict[str, torch.Tensor]] | None = {} if write else None
        for step in range(sequences.schedule.num_steps):
            on_step(step)
            self.engine._run_step(
                layer,
                step,
                ls,
                sequences=sequences,
                write=write,
                on_sequence=on_sequence,
                on_routed=on_routed,
                left=left,
            )
            tick()
        ls.blocks += snapshots
        if left:
            ls.carried = {**ls.carried, **joined(left)}

    def run_calibration(self, *, write: bool, on_routed: Callable[[RoutedStep], None] = _nothing) -> None:
        """The calibration sequences through the layer (counted on the progress bar)."""
        self.run(self.engine.calibration, self.hidden, write=write, on_routed=on_routed, tick=self.count_step)

    def count_step(self) -> None:
        """One step of a run done, on the progress bar (a pass's `tick` for the runs it counts)."""
        self.ticks += 1
        self.tick()


class Pass:
    """An algorithm's part in the layer loop: its hooks (the module docstring says when each runs;
    a hook may reduce over the ranks, every rank calls it alike). The defaults do nothing."""

    rewrites = False  # its runs make the calibration sequences' output: the statistics run only observes
    covers_mtp = True  # runs on the multi-token-prediction layers too
    calibration_runs = 0  # runs of the calibration sequences it adds per layer (for the progress bar)
    # its `reference` does work of its own (besides its counted runs) that grows with the calibration
    # sequences (AWQ's search scores each): the time probe, which runs fewer, scales it to the run's
    per_sequence_work = False

    def own_steps(self) -> int:
        """The most steps of its own sequences it runs in a layer and counts (`LayerWork.count_step`)."""
        return 0

    def begin(self, embed: Callable[[torch.Tensor], LayerState]) -> None:
        """Before layer 0 (not on a resume): `embed(ids [n, T])` -> the layer state entering it (the
        hidden states, and what the layers read of the tokens: eprt.models.decoder.Decoder.first_carried)."""

    def observe(self, layer: LayerWork) -> contextlib.AbstractContextManager[None]:
        """The statistics run happens inside this context."""
        return contextlib.nullcontext()

    def on_routed(self, layer: LayerWork, routed: RoutedStep) -> None:
        """Each step of the statistics run, between the router and the routed experts."""

    def reference(self, layer: LayerWork) -> None:
        """The layer as it is, its statistics final."""

    def quantize(self, layer: LayerWork) -> None:
        """Make the layer, in place, what the export computes."""

    def on_quantized(self, layer: LayerWork) -> None:
        """The layer quantized."""

    def finish(self, engine: LayerEngine, ls: LayerState) -> None:
        """After the last decoder layer; `ls`: the calibration sequences' final hidden states."""


class LayerEngine:
    """Calibrates one rank's share of `samples`, layer by layer, through `passes` (their order is
    their hooks'), over checkpoint `rc` in its dtype. Every rank of `state` runs it alike."""

    read_ahead: bool | None = (
        None  # read the next layer while one computes (eprt.quant.loop.read_ahead); None: on a GPU
    )

    def __init__(
        self,
        state: ParallelState,
        rc: ResolvedCheckpoint,
        samples: torch.Tensor,
        passes: list[Pass],
        *,
        schedule: Schedule,
        progress: bool = True,
    ):
        self.state, self.samples, self.passes, self.progress = state, samples, passes, progress
        self.ck, self.dtype, c = rc.ck, rc.dtype, rc.ck.config
        self.rc = rc.holding(self.experts_held(state, c.num_experts) if c.moe_layers else None)
        self.model = checked_meta(self.rc)
        self.ck.check_decode(self.dtype)  # an encoding this install cannot decode is refused before any read
        self.prefix, self.decoder = self.model.decoder()
        self.names = list(self.model.state_dict())
        self.calibration = Sequences(state, schedule, c.num_experts_per_tok)
        self.steps_per_layer = schedule.num_steps * (1 + sum(p.calibration_runs for p in passes)) + sum(
            p.own_steps() for p in passes
        )
        self.log = logger()
        self.ahead: ReadAhead | None = None  # while `run` runs, with read_ahead

    def experts_held(self, state: ParallelState, num_experts: int) -> tuple[int, int]:
        """(first, count) of the routed experts of each MoE layer this rank holds: its placement's."""
        return state.placement(num_experts).range

    def _assign(self, prefix: str) -> int:
        names = [n for n in self.names if n.startswith(prefix)]
        ahead = self.ahead.take(prefix) if self.ahead is not None else None
        return place_tensors(self.rc, self.model, names, device=self.state.device, read=ahead)

    def embed(self) -> LayerState:
        """The hidden states entering layer 0 (and the passes' own sequences')."""
        decoder, device = self.decoder, self.state.device
        self._assign(self.prefix + "embed_tokens.")

        def entering(ids: torch.Tensor) -> LayerState:
            ids = ids.to(device)
            return LayerState(decoder.embed(ids), [], decoder.first_carried(ids))

        ls = entering(self.samples[self.calibration.mine])
        for p in self.passes:
            p.begin(entering)
        decoder.embed_tokens.to_empty(device="meta")
        return ls

    def run(
        self, first_layer: int, ls: LayerState, after_layer: Callable[[int, LayerState], None] = _nothing
    ) -> LayerState:
        """Layers [first_layer, num_layers) over `ls`; `after_layer(i, ls)` after each (to save it)."""
        layers = self.decoder.layers
        ahead = self.state.device.type == "cuda" if self.read_ahead is None else self.read_ahead
        with (
            cpu_threads(self.state.device),
            bar(
                (len(layers) - first_layer) * self.steps_per_layer, "calibrate", unit="step", enabled=self.progress
            ) as pb,
            ReadAhead(self.rc, self.model, self.names) if ahead else contextlib.nullcontext() as self.ahead,
        ):
            for i in range(first_layer, len(layers)):
                ls = self.run_layer(i, ls, pb)
                after_layer(i, ls)
            self.ahead = None
            for p in self.passes:
                p.finish(self, ls)
        return ls

    def run_layer(self, i: int, ls: LayerState, pb) -> LayerState:
        layer = self.decoder.layers[i]
        prefix = f"{self.prefix}layers.{i}."
        start = time.perf_counter()
        placed = self._assign(prefix)
        read_s = time.perf_counter() - start
        if self.ahead is not None and i + 1 < len(self.decoder.layers):
            self.ahead.start(f"{self.prefix}layers.{i + 1}.")
        sent_before = self.calibration.dispatcher.bytes_sent
        start = time.perf_counter()

        def tick() -> None:
            pb.set_postfix_str(f"layer {i + 1}/{len(self.decoder.layers)}", refresh=False)
            pb.update(1)

        work = LayerWork(self, layer, prefix, i, tick)
        self._through(work, self.passes, lambda: ls)
        pb.update(self.steps_per_layer - work.ticks)  # the runs a pass skipped on this layer
        layer.to_empty(device="meta")
        compute_s, sent = time.perf_counter() - start, self.calibration.dispatcher.bytes_sent - sent_before
        if self.state.rank == 0:
            self.log.info(
                "layer %d: read %.2f s (%.1f MiB), compute %.2f s, exchanged %.1f MiB",
                i,
                read_s,
                placed / 2**20,
                compute_s,
                sent / 2**20,
            )
        return ls

    def run_mtp(self, k: int, prefix: str, hidden: torch.Tensor) -> torch.Tensor:
        """Multi-token-prediction layer k (named `prefix`), as the engines run it: on `hidden` (the
        final hidden states before the final norm, or MTP layer k - 1's output) and the embeddings
        of the tokens k + 1 ahead, through the passes that cover MTP layers, over the calibration
        steps and work units. Returns its output."""
        start, sent_before = time.perf_counter(), self.calibration.dispatcher.bytes_sent
        device = self.state.device
        mtp = load_mtp(self.rc, k, device=device)
        ids = self.samples[self.calibration.mine].to(device)
        work = LayerWork(self, mtp, prefix, None, _nothing)
        self._through(
            work,
            [p for p in self.passes if p.covers_mtp],
            lambda: LayerState(mtp.mtp_input(ids, hidden, shift=k + 1), []),
        )
        mtp.to_empty(device="meta")
        if self.state.rank == 0:
            self.log.info(
                "MTP layer %s: read and compute %.2f s, exchanged %.1f MiB",
                prefix.rstrip("."),
                time.perf_counter() - start,
                (self.calibration.dispatcher.bytes_sent - sent_before) / 2**20,
            )
        return work.hidden.hidden

    def _through(self, work: LayerWork, passes: list[Pass], inputs: Callable[[], LayerState]) -> None:
        """One loaded layer through every hook of `passes`, on the calibration sequences `inputs()`."""

        def on_routed(routed: RoutedStep) -> None:
            for p in passes:
                p.on_routed(work, routed)

        with work.kept:
            with contextlib.ExitStack() as taps:
                for p in passes:
                    taps.enter_context(p.observe(work))
                work.hidden = inputs()  # under the taps: an MTP layer's input projection (eh_proj) is the layer's
                work.run_calibration(write=not any(p.rewrites for p in passes), on_routed=on_routed)
            for p in passes:
                p.reference(work)
            for p in passes:
                p.quantize(work)
            for p in passes:
                p.on_quantized(work)

    @contextlib.contextmanager
    def head(self) -> Iterator[Callable[[LayerState, int], torch.Tensor]]:
        """The decoder's final step and the head, read for the context: `logits(ls, local index)`
        -> that sequence's logits [T, V] from the hidden states after the last layer."""
        layers = self.prefix + "layers."
        tied = self.model.config.tie_word_embeddings
        names = [
            n
            for n in self.names
            if not n.startswith(layers) and (tied or not n.startswith(self.prefix + "embed_tokens."))
        ]
        for prefix in sorted({n.rpartition(".")[0] + "." for n in names}):
            self._assign(prefix)

        def logits(ls: LayerState, li: int) -> torch.Tensor:
            return self.model.logits(self.decoder.final(ls.hidden[li : li + 1], ls.of_sequence(li)[0]))[0]

        try:
            yield logits
        finally:
            for module in sorted({n.rpartition(".")[0] for n in names}):
                self.model.get_submodule(module).to_empty(device="meta")

    def _run_step(
        self,
        layer: nn.Module,
        step: int,
        ls: LayerState,
        *,
        sequences: Sequences,
        write: bool = True,
        on_sequence: Callable[[int], None] = _nothing,
        on_routed: Callable[[RoutedStep], None] = _nothing,
        left: dict[int, dict[str, torch.Tensor]] | None = None,
    ) -> None:
        """One step of one layer: its sequences' dense blocks one sequence each, then its routed
        block's experts over the step's work units; each output replaces its sequence's hidden
        state (unless not `write`: a run that only feeds the taps). `left`, where given, gets
        by local index what each sequence's dense blocks left in its context's `carried`.

        Each sequence's dense part runs whole on one thread, on eprt.kernels.cpu_workers' threads
        side by side: its rows are the sequence's whatever thread runs it, so the bits are the
        same, and what observes a call (calibration's amax, GPTQ's exact Hessian sums) does not
        depend on the order of the calls. `on_sequence(local index)` is told, on the thread that
        runs it, which sequence's dense part comes next (the quality report files its probes'
        calls per sequence)."""
        T = sequences.schedule.seq_len
        moe = layer.routed
        mine = [(s, sequences.local[s]) for s in sequences.schedule.step_sequences(step) if s in sequences.local]
        pending: list[Pending] = [None] * len(mine)  # filled by `dense`, one per sequence, on the workers

        def dense(j: int, _) -> None:
            s, li = mine[j]
            on_sequence(li)
            snapshots, carried = ls.of_sequence(li)
            handed = dict(carried)
            context = self.decoder.context(T, self.dtype, self.state.device, snapshots, carried)
            x = ls.hidden[li : li + 1]
            if moe is None:
                out = layer(x, context)[0]
                if left is not None:
                    left[li] = newly_carried(context, handed)
                if write:
                    ls.hidden[li] = out
                return
            carry, m = layer.before_routed(x, context)
            if left is not None:
                left[li] = newly_carried(context, handed)
            m_TD = m.reshape(T, -1)
            pending[j] = Pending(s, li, context, carry, m_TD, *layer.route(m_TD, context))

        for_each(range(len(mine)), lambda: None, dense, self.state.device)
        if moe is None:
            return
        routed_step = self._step_tokens(moe, sequences, step, pending)
        on_routed(routed_step)
        routed = self._routed(routed_step, pending)

        def finish(j: int, _) -> None:
            p = pending[j]
            on_sequence(p.local)
            out = layer.after_routed(p.carry, moe.finish(p.moe_in_TD, routed[j])[None], p.context)[0]
            if write:
                ls.hidden[p.local] = out

        for_each(range(len(pending)), lambda: None, finish, self.state.device)

    def _step_tokens(self, moe: MoE, sequences: Sequences, step: int, pending: list[Pending]) -> RoutedStep:
        T, dev = sequences.schedule.seq_len, self.state.device
        if pending:
            x_TD = torch.cat([p.experts_in_TD for p in pending])
        else:
            x_TD = torch.empty(0, moe.experts.w_in.shape[-1], dtype=self.dtype, device=dev)
        seq_T = torch.tensor([p.sequence for p in pending], dtype=torch.int64, device=dev).repeat_interleave(T)
        key_T = seq_T * T + torch.arange(T, device=dev).repeat(len(pending))
        return RoutedStep(moe, sequences, step, x_TD, seq_T, key_T)

    def _routed(self, rs: RoutedStep, pending: list[Pending]) -> list[torch.Tensor]:
        """Each pending sequence's fp32 routed sum, through the step's work units on their ranks."""
        T, K = rs.sequences.schedule.seq_len, self.ck.config.num_experts_per_tok
        dev = self.state.device
        if pending:
            ids_TK = torch.cat([p.topk_ids_TK for p in pending])
            w_TK = torch.cat([p.topk_weights_TK for p in pending])
        else:
            ids_TK = torch.empty(0, K, dtype=torch.int64, device=dev)
            w_TK = torch.empty(0, K, dtype=torch.float32, device=dev)
        key_TK = (rs.key_T * K)[:, None] + torch.arange(K, device=dev)
        y_TD = rs.sequences.dispatcher(rs.x_TD, ids_TK, w_TK, key_TK, rs.unit_T, rs.groups, rs.moe.experts)
        return list(y_TD.split(T)) if pending else []
