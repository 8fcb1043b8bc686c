"""Layer-major calibration: one decoder layer resident at a time.

Every rank holds the hidden states of its own calibration sequences (rank r: sequences r,
r + world, ...). For each decoder layer in order it reads that layer's dense weights and its own
routed experts, runs the layer over its sequences step by step, sends each routed token to the
rank computing its work unit and back, records the calibration statistics, frees the layer and
goes on. Every weight byte is read once; a rank's peak is one layer's weights, the hidden states
and one step's exchange buffers.

Layout invariance comes from canonical work units, not from batch-invariant kernels: every
matmul sees rows that are a function of the model and the data alone.
- The dense part of a layer (attention, dense MLP, router, shared experts) runs one sequence a
  call: its rows are that sequence's tokens (a step's sequences side by side on CPU workers).
- A routed expert runs over the copies routed to it from one group of `group_size` consecutive
  global sequences (a constant of the model and the data: `group_tokens`), in (sequence,
  position, k) order, as one matmul (eprt.parallel.dispatch.UnitDispatcher).
- A token's top-k outputs are summed in k order, in fp32.
A step holds whole groups, so neither the world, ep, edp, batch nor chunk size changes a bit.

With --calibrate-all-experts every token also runs through every routed expert of its layer,
for the statistics only (`LayerEngine._observe_every_expert`): expert e's statistics unit for
group g holds all of g's tokens in (sequence, position) order, as one matmul on the rank that
computes the routed unit (e, g). The layer's output still comes from its top-k alone.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch

from eprt.kernels.cpu_workers import cpu_workers, for_each
from eprt.storage.checkpoint import Checkpoint
from eprt.models.deepseek_v3 import load_mtp
from eprt.models.loader import meta_model
from eprt.models.resolved import place_tensors
from eprt.models.moe import MoE
from eprt.parallel.dispatch import UnitDispatcher
from eprt.progress import bar, logger
from eprt.quant.calibrate import Calibrator
from eprt.quant.gptq_layer import GPTQRun, LayerGPTQ
from eprt.quant.preview import fake_quantize
from eprt.quant.quality import QualityReport
from eprt.quant.scales import source_dtype

# Rows an expert's work unit holds on average: enough for a matmul worth a call, few enough
# that a step's exchange buffers stay a sliver of a layer. On a CPU with bf16 arithmetic (AMX)
# a 256-row expert matmul runs at 1.3x the rate of a 128-row one, 512 rows at 1.6x; with 256
# rows bench/modelopt.py's model calibrates in 15.0 s against 17.4 s with 128, its peak RSS
# 0.81-0.84 GB against 0.72-0.82 GB (2 runs each; 512 rows peak at 0.98 GB).
UNIT_ROWS = 256


def group_tokens(num_experts: int, top_k: int) -> int:
    """Tokens per group of sequences, so that each expert's unit holds UNIT_ROWS rows on average."""
    return UNIT_ROWS * max(num_experts, 1) // max(top_k, 1)


@dataclass(frozen=True)
class Schedule:
    """Which sequences each step of every layer runs: the same on every rank."""

    num_sequences: int
    seq_len: int
    group_size: int  # sequences per expert work unit's group
    groups_per_step: int

    @classmethod
    def of(cls, num_sequences: int, seq_len: int, step_sequences: int, group_tokens: int) -> Schedule:
        group_size = max(1, group_tokens // seq_len)
        return cls(num_sequences, seq_len, group_size, max(1, math.ceil(step_sequences / group_size)))

    @property
    def num_groups(self) -> int:
        return math.ceil(self.num_sequences / self.group_size)

    @property
    def num_steps(self) -> int:
        return math.ceil(self.num_groups / self.groups_per_step)

    def step_groups(self, step: int) -> tuple[int, int]:
        """(first group, count) of `step`."""
        first = step * self.groups_per_step
        return first, min(self.groups_per_step, self.num_groups - first)

    def step_sequences(self, step: int) -> range:
        first, count = self.step_groups(step)
        return range(first * self.group_size, min(self.num_sequences, (first + count) * self.group_size))


def cpu_threads(device: torch.device):
    """On CPU, torch's threads (OMP_NUM_THREADS; torchrun starts its ranks with 1) as workers
    that take whole pieces (a sequence's dense part, the experts of a matmul call), and every
    operation itself on one thread: the CPU's reductions (the norms' means) and the BLAS's small
    matmuls split their work by the thread count, and the last bits follow the split
    (eprt.kernels.cpu_workers)."""
    if device.type != "cpu":
        return contextlib.nullcontext()
    return cpu_workers(torch.get_num_threads())


class LayerState:
    """One rank's sequences as they stand at a layer boundary: the hidden states
    [n, T, H] and, with attention residuals, the block snapshots (each [n, T, H])."""

    def __init__(self, hidden: torch.Tensor, blocks: list[torch.Tensor]):
        self.hidden, self.blocks = hidden, blocks


def own_sequences(num_sequences: int, rank: int, world: int) -> list[int]:
    """The global indices of this rank's sequences (eprt.data.rank_batches takes the same)."""
    return list(range(rank, num_sequences, world))


class Held:
    """The held-out sequences of the quality report on this rank: their schedule, their share,
    their own work units' dispatcher, and two streams (reference, quantized) at a layer boundary."""

    def __init__(self, state, report: QualityReport, schedule: Schedule, top_k: int):
        n, T = report.eval_ids.shape
        self.report, self.schedule = report, schedule
        self.mine = own_sequences(n, state.rank, state.world)
        self.local = {s: i for i, s in enumerate(self.mine)}
        self.dispatcher = UnitDispatcher(state, n * T * max(top_k, 1))
        self.ref: LayerState | None = None
        self.quant: LayerState | None = None

    @property
    def pairs(self) -> list[tuple[int, int]]:
        return list(self.local.items())


class LayerEngine:
    """Calibrates one rank's share, layer by layer. Every rank of `state` runs it alike.

    With `quality` (and its `eval_schedule`), each layer then runs the held-out sequences too,
    unquantized and quantized, for the report (eprt.quant.quality)."""

    def __init__(self, state, ck: Checkpoint, cal: Calibrator, samples: torch.Tensor, *, dtype: torch.dtype,
                 schedule: Schedule, progress: bool = True, quality: QualityReport | None = None,
                 eval_schedule: Schedule | None = None, gptq: GPTQRun | None = None):
        self.state, self.ck, self.cal, self.dtype, self.schedule = state, ck, cal, dtype, schedule
        # with GPTQ, each layer runs three passes (max, Hessians, quantized) and passes on its quantized output
        self.gptq = gptq
        self.samples, self.progress = samples, progress
        c = ck.config
        self.expert_range = state.placement(c.num_experts).range if c.moe_layers else None
        self.model, self.rc = meta_model(ck, self.expert_range, dtype)
        ck.check_decode(dtype)  # an encoding this install cannot decode is refused before any read
        self.prefix, self.decoder = self.model.decoder()
        self.names = list(self.model.state_dict())
        self.mine = own_sequences(samples.shape[0], state.rank, state.world)
        self.local = {s: i for i, s in enumerate(self.mine)}
        self.dispatcher = UnitDispatcher(state, samples.shape[0] * samples.shape[1] * max(c.num_experts_per_tok, 1))
        self.held = Held(state, quality, eval_schedule, c.num_experts_per_tok) if quality is not None else None
        self.log = logger()

    def _assign(self, prefix: str) -> int:
        names = [n for n in self.names if n.startswith(prefix)]
        return place_tensors(self.rc, self.model, names, device=self.state.device)

    def embed(self) -> LayerState:
        """The hidden states entering layer 0."""
        table = self.decoder.embed_tokens
        self._assign(self.prefix + "embed_tokens.")
        ids = self.samples[self.mine].to(self.state.device)
        hidden = table(ids)
        if self.held is not None:
            held = table(self.held.report.eval_ids[self.held.mine].to(self.state.device))
            self.held.ref, self.held.quant = LayerState(held, []), LayerState(held.clone(), [])
        table.to_empty(device="meta")
        return LayerState(hidden, [])

    def run(self, first_layer: int, ls: LayerState, after_layer=None) -> LayerState:
        """Layers [first_layer, num_layers) over `ls`; `after_layer(i, ls)` after each (to save it)."""
        layers = self.decoder.layers
        steps = self.schedule.num_steps * (3 if self.gptq is not None else 1)
        with cpu_threads(self.state.device), \
                bar((len(layers) - first_layer) * steps, "calibrate", unit="step", enabled=self.progress) as pb:
            for i in range(first_layer, len(layers)):
                ls = self.run_layer(i, ls, pb)
                if after_layer is not None:
                    after_layer(i, ls)
            if self.held is not None:
                self._evaluate_head()
            self.run_mtp(ls)
        return ls

    def mtp_prefixes(self) -> list[str]:
        """The multi-token-prediction layers the recipe quantizes a module of (DeepSeek-V3's
        `model.layers.{num_hidden_layers + k}`), in order; the chain stops at the first it skips."""
        c = self.ck.config
        out = []
        for k in range(c.num_nextn_predict_layers):
            prefix = f"{self.prefix}layers.{c.num_layers + k}."
            if not any(t.startswith(prefix) for t in self.cal.targets):
                break
            out.append(prefix)
        return out

    def run_mtp(self, ls: LayerState) -> None:
        """After the last decoder layer, each MTP layer the recipe quantizes, as the engines run
        them: on the final hidden states (before the final norm) and the next tokens' embeddings,
        its decoder layer over the same steps and work units as the others. `ls` is left as it is."""
        ids = self.samples[self.mine].to(self.state.device)
        hidden = ls.hidden
        for k, prefix in enumerate(self.mtp_prefixes()):
            start, sent_before = time.perf_counter(), self.dispatcher.bytes_sent
            mtp = load_mtp(self.rc, k, device=self.state.device)
            self.cal.observe(mtp, prefix)
            mtp_ls = LayerState(mtp.mtp_input(ids, hidden, shift=k + 1), [])
            try:
                for step in range(self.schedule.num_steps):
                    self._run_step(mtp, step, mtp_ls, write=self.gptq is None)
            finally:
                self.cal.close()
            self._quantize_layer(None, mtp, prefix, mtp_ls, None)
            hidden = mtp_ls.hidden
            mtp.to_empty(device="meta")
            if self.state.rank == 0:
                self.log.info("MTP layer %s: read and compute %.2f s, exchanged %.1f MiB", prefix.rstrip("."),
                              time.perf_counter() - start, (self.dispatcher.bytes_sent - sent_before) / 2**20)

    def run_layer(self, i: int, ls: LayerState, pb) -> LayerState:
        layer = self.decoder.layers[i]
        prefix = f"{self.prefix}layers.{i}."
        start = time.perf_counter()
        placed = self._assign(prefix)
        read_s = time.perf_counter() - start
        sent_before = self.dispatcher.bytes_sent
        start = time.perf_counter()
        self.cal.observe(layer, prefix)
        # a block's first layer files its input as the block's snapshot
        snapshot = ls.hidden.clone() if getattr(layer, "attn_res", False) and layer.starts_block else None
        try:
            for step in range(self.schedule.num_steps):
                self._run_step(layer, step, ls, write=self.gptq is None)
                pb.set_postfix_str(f"layer {i + 1}/{len(self.decoder.layers)}", refresh=False)
                pb.update(1)
        finally:
            self.cal.close()
        self._quantize_layer(i, layer, prefix, ls, pb)
        if snapshot is not None:
            ls.blocks.append(snapshot)
        layer.to_empty(device="meta")
        compute_s, sent = time.perf_counter() - start, self.dispatcher.bytes_sent - sent_before
        if self.state.rank == 0:
            self.log.info("layer %d: read %.2f s (%.1f MiB), compute %.2f s, exchanged %.1f MiB", i, read_s,
                          placed / 2**20, compute_s, sent / 2**20)
        return ls

    def _quantize_layer(self, i: int | None, layer, prefix: str, ls: LayerState, pb) -> None:
        """Once the max pass over `layer` (decoder layer i; None: an MTP layer, which the quality
        report does not cover) is done, with GPTQ or the quality report: the layer's amax made
        final over the ranks; the report's reference stream through the layer as it is; GPTQ's
        Hessian pass; then the layer quantized in place as the export writes it (GPTQ's weights
        where it ran, eprt.quant.preview.fake_quantize for the rest, the inputs and the KV cache),
        through which run the report's quantized stream and GPTQ's quantized pass, whose output
        replaces `ls.hidden` (eprt.quant.gptq_layer). One quantization serves both."""
        held = self.held if i is not None else None
        if self.gptq is None and held is None:
            return
        self.cal.reduce_amax(self.state, prefix)
        if held is not None:
            self._held_pass(layer, held.ref)
        g = LayerGPTQ(self.gptq, layer, prefix, self.cal) if self.gptq is not None else None
        if g is not None and g.needs_hessians:
            g.observe()
            try:
                self._steps(layer, ls, pb, write=False)
            finally:
                g.close()
        elif g is not None and pb is not None:
            pb.update(self.schedule.num_steps)
        # the probes keep the original weights: installed before any is replaced
        errors, unprobe = held.report.probe(layer, prefix, held.schedule.num_groups) if held else (None, None)
        unquantize = None
        try:
            if g is not None:
                g.quantize()
                g.free()
            report = self.held.report if self.held is not None else None
            unquantize = fake_quantize(layer, self.cal.targets, (report or self.gptq).recipe, self.cal, self.state,
                                       prefix=prefix, source_dtype=lambda name: source_dtype(self.ck, name),
                                       on_weight=report.on_weight if held is not None else None,
                                       quantized=g.modules if g is not None else ())
            if held is not None:
                self._held_pass(layer, held.quant, errors)
                unprobe()
                unprobe = None
            if g is not None:  # the probes measure the held-out sequences only
                self._steps(layer, ls, pb, write=True)
        finally:
            if unprobe is not None:
                unprobe()
            if unquantize is not None:
                unquantize()
        if held is not None:
            held.report.finish_layer(i, prefix, held.pairs, held.ref.hidden, held.quant.hidden, errors)

    def _steps(self, layer, ls: LayerState, pb, write: bool) -> None:
        for step in range(self.schedule.num_steps):
            self._run_step(layer, step, ls, write=write)
            if pb is not None:
                pb.update(1)

    def _run_step(self, layer, step: int, ls: LayerState, write: bool = True, on_sequence=None) -> None:
        """One step of one layer: its sequences' dense parts one sequence each, the routed experts
        over the step's work units; each output replaces its sequence's hidden state (unless not
        `write`: a pass that only observes).

        Each sequence's dense part runs whole on one thread, on eprt.kernels.cpu_workers' threads
        side by side: its rows are the sequence's whatever thread runs it, so the bits are the
        same, and what observes a call (calibration's amax, GPTQ's exact Hessian sums) does not
        depend on the order of the calls. `on_sequence(local index)` is told, on the thread that
        runs it, which sequence's dense part comes next (the quality report files its probes'
        calls per sequence)."""
        T = self.schedule.seq_len
        ffn = layer.ffn()
        moe = isinstance(ffn, MoE)
        mine = [(s, self.local[s]) for s in self.schedule.step_sequences(step) if s in self.local]
        # per sequence: (global index, local index, residual, MLP input, routed experts' input, top-k ids, weights)
        pending: list = [None] * len(mine)

        def dense(j: int, _) -> None:
            s, li = mine[j]
            if on_sequence is not None:
                on_sequence(li)
            blocks = [b[li:li + 1] for b in ls.blocks]
            args = self.decoder.layer_args(T, self.dtype, self.state.device, blocks)
            carry, m = layer.attend(ls.hidden[li:li + 1], *args)
            if not moe:
                out = (carry + ffn(m))[0]
                if write:
                    ls.hidden[li] = out
                return
            m_TD = m.reshape(T, -1)
            pending[j] = (s, li, carry, m_TD, *ffn.route(m_TD))

        for_each(range(len(mine)), lambda: None, dense, self.state.device)
        if not moe:
            return
        self._observe_every_expert(ffn, step, pending)
        routed = self._routed(ffn, step, pending)

        def finish(j: int, _) -> None:
            s, li, carry, m_TD, *_ = pending[j]
            if on_sequence is not None:
                on_sequence(li)
            out = (carry + ffn.finish(m_TD, routed[j]).view_as(carry))[0]
            if write:
                ls.hidden[li] = out

        for_each(range(len(pending)), lambda: None, finish, self.state.device)

    def _observe_every_expert(self, moe: MoE, step: int, pending: list) -> None:
        """--calibrate-all-experts: every token of the step through every routed expert, for the
        observers only (the layer's output is the routed one, untouched). Each expert's rows are
        whole groups of sequences in (sequence, position) order, each group one matmul on the
        rank that computes the expert's routed unit of that group: the rows are a function of
        the data alone, as the routed units' are. Skipped, on every rank alike, where the recipe
        leaves the experts unquantized."""
        if moe.experts.all_observer is None:
            return
        x_TD, seq_T, key_T = self._step_tokens(moe, pending)
        x_sorted, rows_per_unit_U = self.dispatcher.every_expert_rows(
            x_TD, key_T, seq_T // self.schedule.group_size, self.schedule.step_groups(step))
        moe.experts.observe_every_expert(x_sorted, rows_per_unit_U)

    def _step_tokens(self, moe: MoE, pending: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The routed experts' input of the step's pending sequences [T, width], each token's
        global sequence [T] and its global key, sequence x seq_len + position [T]."""
        T, dev = self.schedule.seq_len, self.state.device
        if pending:
            x_TD = torch.cat([p[4] for p in pending])
        else:
            x_TD = torch.empty(0, moe.experts.w13.shape[-1], dtype=self.dtype, device=dev)
        seq_T = torch.tensor([p[0] for p in pending], dtype=torch.int64, device=dev).repeat_interleave(T)
        return x_TD, seq_T, seq_T * T + torch.arange(T, device=dev).repeat(len(pending))

    def _routed(self, moe: MoE, step: int, pending: list) -> list[torch.Tensor]:
        """Each pending sequence's fp32 routed sum, through the step's work units on their ranks."""
        T, K = self.schedule.seq_len, self.ck.config.num_experts_per_tok
        dev = self.state.device
        x_TD, seq_T, key_T = self._step_tokens(moe, pending)
        if pending:
            ids_TK = torch.cat([p[5] for p in pending])
            w_TK = torch.cat([p[6] for p in pending])
        else:
            ids_TK = torch.empty(0, K, dtype=torch.int64, device=dev)
            w_TK = torch.empty(0, K, dtype=torch.float32, device=dev)
        key_TK = (key_T * K)[:, None] + torch.arange(K, device=dev)
        y_TD = self.dispatcher(x_TD, ids_TK, w_TK, key_TK, seq_T // self.schedule.group_size,
                               self.schedule.step_groups(step), moe.experts)
        return list(y_TD.split(T)) if pending else []

    # --- the quality report (eprt.quant.quality) ----------------------------------------------
    @contextlib.contextmanager
    def _over_held(self):
        """Steps run over the held-out sequences, with their own schedule and work units."""
        held, saved = self.held, (self.schedule, self.local, self.dispatcher)
        self.schedule, self.local, self.dispatcher = held.schedule, held.local, held.dispatcher
        try:
            yield
        finally:
            self.schedule, self.local, self.dispatcher = saved

    def _held_pass(self, layer, ls: LayerState, errors=None) -> None:
        """One stream of the held-out sequences through `layer` (`errors`: the quantized stream's
        probes, told each step's first work unit)."""
        snapshot = ls.hidden.clone() if getattr(layer, "attn_res", False) and layer.starts_block else None
        with self._over_held():
            for step in range(self.schedule.num_steps):
                if errors is not None:
                    errors.first_unit = self.schedule.step_groups(step)[0]
                self._run_step(layer, step, ls, on_sequence=errors.enter if errors is not None else None)
        if snapshot is not None:
            ls.blocks.append(snapshot)

    def _evaluate_head(self) -> None:
        """After the last layer: the decoder's final step and the head over both streams."""
        held, layers = self.held, self.prefix + "layers."
        tied = self.model.config.tie_word_embeddings
        names = [n for n in self.names if not n.startswith(layers)
                 and (tied or not n.startswith(self.prefix + "embed_tokens."))]
        for prefix in sorted({n.rpartition(".")[0] + "." for n in names}):
            self._assign(prefix)

        def logits_of(li: int) -> tuple[torch.Tensor, torch.Tensor]:
            out = (self.decoder.final(ls.hidden[li:li + 1], [b[li:li + 1] for b in ls.blocks])
                   for ls in (held.ref, held.quant))
            return tuple(self.model.logits(h)[0] for h in out)

        held.report.finish(held.pairs, logits_of)
        for module in sorted({n.rpartition(".")[0] for n in names}):
            self.model.get_submodule(module).to_empty(device="meta")
