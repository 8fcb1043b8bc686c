"""The memory plan of a layer-major calibration: each rank's peak, from the manifest alone.

A rank holds, at its peak, what it held before the run (the process: interpreter, torch,
eprt; measured when the plan is made, so the plan covers it), the hidden states of its own
sequences (and what its layers carry across: Kimi-K3's block snapshots, GLM-5's shared top-k),
and the larger of: the embedding table while the first hidden states are formed, or one decoder
layer's weights with one step's buffers (the activations of the sequences whose dense parts run
side by side, the routed copies sent, received, sorted and returned, the experts' intermediate
rows, the fp32 combine; with --calibrate-all-experts, the larger of those and the statistics
pass's) and the largest tensor in flight as it is read.

The quality report (eprt.quant.quality) adds the hidden states of its held-out sequences, twice
(a reference and a quantized stream); while a layer runs them quantized, a copy of the layer's
quantized weights as they were (its probes compare against them) and one held-out step's
buffers with the probes' reference outputs; and at the end the final norm and the head, with
one sequence's logits of both streams.

The format search (--auto-quantize, eprt.quant.algorithms.search.passes) adds three more streams of
the calibration sequences (the layer's input, its output as it is, its output with one module group
fake-quantized) and, while it runs, a copy of that group's weights: no more than the quality
report's copy of every quantized weight of the layer, which comes after it.

A GPU rank also holds, outside torch's allocations, the CUDA context, cuBLAS's workspaces and NCCL's
buffers, and its caching allocator reserves above what is allocated (eprt.quant.run.device_terms); its
attention keeps no T x T scores. It holds host memory too, planned apart and checked against the host's own limit: the
process, the token ids, a tensor as it is read before it moves to the device, the next layer read
ahead while one computes (eprt.quant.loop.read_ahead), the hidden states as a save copies them to the host
(eprt.quant.run.workdir: written while the next layer computes), and GPTQ's codes,
which move to the host as each layer is rounded and stay there until the output is written.
On a CPU rank the host is the device, and those terms are in its one plan.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from eprt.errors import ConfigError
from eprt.layout import EXPERT_LEAVES, layer_of
from eprt.loading.loader import checked_meta
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.quant.algorithms.awq.plan import AWQLayer, awq_bytes, awq_layers
from eprt.quant.algorithms.gptq.layer import MOST_EXPERTS_STACKED
from eprt.quant.algorithms.gptq.solve import columns_held_bytes, columns_of
from eprt.quant.loop.sequences import Schedule, own_sequences
from eprt.quant.quality import REFERENCE_PARTS
from eprt.quant.run.device_terms import ALLOCATOR_RESERVE, attention_scores, fixed_on_gpu
from eprt.storage.checkpoint import Checkpoint
from eprt.units import format_bytes


def current_rss() -> int:
    """Bytes this process holds now (resident set), 0 where /proc is not there."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


def peak_rss() -> int:
    """The largest resident set this process has had, in bytes: /proc's VmHWM, which starts
    afresh at exec (getrusage's ru_maxrss keeps the high-water mark of the process that forked
    this one: a large parent makes a small child look large)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def memory_in_use(device: torch.device) -> int:
    """What the plan's baseline is: the process's resident set on CPU, torch's allocations on CUDA."""
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else current_rss()


def measured_peak(device: torch.device) -> int:
    """What the plan predicts: the peak resident set on CPU, torch's peak allocation on CUDA."""
    return torch.cuda.max_memory_allocated(device) if device.type == "cuda" else peak_rss()


def available_memory(device: torch.device) -> int:
    """The default --max-memory: the device's free memory on CUDA, the host's available RAM on CPU."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


# What bf16 matmuls on CPU keep once a layer has run: oneDNN's cached primitives (one per
# shape it was given; unit rows come padded to a few dozen shapes) and the allocator's arenas.
# Measured on the bench model (hidden 1024, 32 experts), 60-100 MiB; fp32 goes to MKL, which
# keeps nothing.
CPU_BF16_KERNEL_CACHE = 64 * 2**20


@dataclass(frozen=True)
class MemoryPlan:
    baseline: int  # the process before the run, with what its kernels will cache
    hidden: (
        int  # hidden states and what the layers carry across (block snapshots, shared top-k) of this rank's sequences
    )
    embedding: int
    layer: int  # the largest layer's weights (dense + this rank's experts)
    reading: int  # the most a layer holds while it is read: tensors placed so far, one in flight
    step: int  # one step's activations and exchange buffers
    gptq: int = 0  # with GPTQ: a layer's Hessians (int64) and one solve's working set, beside the layer
    awq: int = (
        0  # with AWQ: a layer's samples and its search's working set (eprt.quant.algorithms.awq.plan), before GPTQ's
    )
    codes: int = 0  # with GPTQ on CPU: its quantized weights kept until the output is written (on GPU: `host`)
    eval_layer: int = 0  # the quality report: the largest layer's weights with the copy of its quantized ones
    eval_step: int = 0  # one held-out step's buffers, with the probes'
    head: int = 0  # the final norm and the head with one sequence's logits, after the last layer
    tokens: int = 0  # the calibration (and held-out) token ids, as read and as packed into sequences
    host: HostPlan | None = None  # on a GPU rank, what it holds in host memory; None on CPU (the host is the device)
    # on CPU: a save's copy of the hidden states, written while the next layer computes (on a GPU: `host.saved`)
    saving: int = 0
    expert_stack: int = MOST_EXPERTS_STACKED  # with GPTQ: routed experts solved at once (the run takes it from here)
    # on a GPU (eprt.quant.run.device_terms): the CUDA context, cuBLAS's workspaces and NCCL's buffers, and
    # the caching allocator's reserve above the allocated peak, as a share of it
    fixed: int = 0
    reserve: float = 0.0

    @property
    def peak(self) -> int:
        return self.allocated + int(self.allocated * self.reserve) + self.fixed

    @property
    def allocated(self) -> int:
        """The peak of what torch allocates: on a GPU, the allocator's allocated high-water mark."""
        return (
            self.baseline
            + self.hidden
            + self.saving
            + self.tokens
            + self.codes
            + max(
                self.embedding,
                self.reading,
                self.layer + self.step + max(self.gptq, self.awq),
                self.eval_layer + self.eval_step,
                self.head,
            )
        )

    def summary(self) -> str:
        """'peaks at X (its terms)', and on a GPU what the host holds: the run logs it, the dry run prints it."""
        host = f"; on the host {format_bytes(self.host.peak)} ({self.host.terms()})" if self.host else ""
        return f"peaks at {format_bytes(self.peak)} ({self.terms()}){host}"

    def terms(self) -> str:
        text = (
            f"layer {format_bytes(self.layer)}, hidden states {format_bytes(self.hidden)}, step "
            f"{format_bytes(self.step)}, process {format_bytes(self.baseline)}"
        )
        if self.saving:
            text += f", a save's copy being written {format_bytes(self.saving)}"
        if self.fixed:
            text += (
                f", CUDA context, cuBLAS and NCCL {format_bytes(self.fixed)}, the allocator's reserve "
                f"{format_bytes(int(self.allocated * self.reserve))}"
            )
        if self.gptq:
            text += f", GPTQ's Hessians {format_bytes(self.gptq)} (experts solved {self.expert_stack} at a time)"
            text += f", its codes {format_bytes(self.codes)}" if self.codes else ""  # on a GPU: the host's
        if self.awq:
            text += f", AWQ's samples and search {format_bytes(self.awq)}"
        if self.eval_layer:
            text += (
                f", quality report: layer with its copy {format_bytes(self.eval_layer)}, held-out step "
                f"{format_bytes(self.eval_step)}, head {format_bytes(self.head)}"
            )
        return text


@dataclass(frozen=True)
class HostPlan:
    """What a GPU rank holds in host memory at its peak."""

    baseline: int  # the process's resident set before the run
    tokens: int  # the token ids, as read and as packed
    reading: int  # the largest tensor as read, before it moves to the device
    codes: int  # GPTQ's codes of every layer, kept until the output is written
    ahead: int = 0  # the next layer's share, read ahead while one computes (eprt.quant.loop.read_ahead)
    saved: int = 0  # a save's copy of the hidden states (and streams), written to the work directory

    @property
    def peak(self) -> int:
        return self.baseline + self.tokens + self.reading + self.ahead + self.saved + self.codes

    def terms(self) -> str:
        return (
            f"process {format_bytes(self.baseline)}, token ids {format_bytes(self.tokens)}, a tensor as read "
            f"{format_bytes(self.reading)}, the next layer read ahead {format_bytes(self.ahead)}, a save's copy of "
            f"the hidden states {format_bytes(self.saved)}, GPTQ's codes {format_bytes(self.codes)}"
        )


@dataclass(frozen=True)
class GPTQLinear:
    """What GPTQ holds for one Linear of a layer (a routed experts' weight: all its experts)."""

    hessian: int  # the int64 sums of all its experts
    weight: int  # one weight as read for the solve, in fp32
    weight_solve: int  # what one weight's solve holds for its whole length
    factoring: int  # what factoring one Hessian holds for a moment beside the solve
    experts: int  # its routed experts; 0 for a dense Linear

    @classmethod
    def of(cls, count: int, out_dim: int, in_dim: int, routed: bool, fmt: str | None = None) -> GPTQLinear:
        # per weight solved: the fp64 inverse factor, W in fp64 with its working block, the fp32
        # result, the stack's copies of the weights as read and its column rounding's tables (of
        # format `fmt`); factoring: the fp64 Hessian, its Cholesky factor, the inverse and its
        # factor (eprt.quant.algorithms.gptq.solve._inverse_factor)
        square = in_dim * in_dim * 8
        solve = square + 3 * out_dim * in_dim * 8 + (columns_held_bytes(fmt, out_dim, in_dim) if fmt else 0)
        return cls(count * square, out_dim * in_dim * 4, solve, 4 * square, count if routed else 0)

    def held(self, ep: int) -> int:
        """The Hessians one rank holds: its share of the routed experts'."""
        return self.hessian // ep if self.experts else self.hessian

    def solve(self, ep: int, stack: int) -> int:
        """One solve's peak on a rank of `ep`: every weight it holds as read (the stacks are cut from
        them), and routed experts solved `stack` at a time (at most the rank's own)."""
        if not self.experts:
            return self.weight + self.weight_solve + self.factoring
        mine = self.experts // ep
        return mine * self.weight + min(stack, mine) * self.weight_solve + self.factoring


@dataclass(frozen=True)
class RunShape:
    """What a plan prices besides the model: where the rank sits, the data's sizes and the steps
    that cut them."""

    rank: int
    world: int
    ep: int
    num_sequences: int
    seq_len: int
    step_sequences: int  # sequences per step of a layer, over all ranks
    group_tokens: int  # tokens per expert work unit's group of sequences
    all_experts: bool = False  # --calibrate-all-experts' statistics pass
    eval_sequences: int = 0  # the quality report's held-out sequences (0: no report)
    search: bool = False  # the format search's streams of the calibration sequences

    def schedule_of(self, num_sequences: int) -> Schedule:
        """The steps and expert work units of `num_sequences` sequences of this shape's length."""
        return Schedule.of(num_sequences, self.seq_len, self.step_sequences, self.group_tokens)

    @property
    def schedule(self) -> Schedule:
        return self.schedule_of(self.num_sequences)

    @property
    def eval_schedule(self) -> Schedule | None:
        return self.schedule_of(self.eval_sequences) if self.eval_sequences else None


@dataclass(frozen=True)
class Planner:
    """The weight terms of a plan, from the manifest once; `plan` then prices any layout and data size."""

    ck: Checkpoint
    dtype: torch.dtype
    # per layer, its tensors in the order they are read: (bytes placed, bytes in flight beside
    # them while read, routed experts: a rank holds 1/ep of both, quantized: the quality report
    # keeps a copy)
    reads: dict[int, list[tuple[int, int, bool, bool]]]
    embedding: int
    kernel_cache: int
    head: int = 0  # what the decoder's final step and the head read after the last layer
    # with GPTQ, per decoder layer its Linears' Hessians and solves, every 2-D weight counted (an
    # upper bound: not every one is quantized); an MTP layer is a decoder layer's size
    hessians: dict[int, list[GPTQLinear]] | None = None
    codes: tuple[int, int] = (0, 0)  # GPTQ's codes of the modules it rounds: (dense bytes, routed experts' bytes)
    largest_read: tuple[int, int] = (0, 0)  # the largest tensor as stored: (dense bytes, routed experts' bytes)
    device: str = "cpu"
    # sequences whose dense parts run side by side: on CPU one a worker thread (the engine's
    # eprt.kernels.cpu_workers, as many as torch's threads)
    workers: int = 1
    awq: dict[int, AWQLayer] | None = None  # with AWQ, per decoder layer what its groups keep

    @classmethod
    def of(
        cls,
        rc: ResolvedCheckpoint,
        device: torch.device,
        targets=(),
        mtp: bool = False,
        gptq: Mapping[str, str] | None = None,
        awq: Mapping[str, str] | None = None,
    ) -> Planner:
        """The plan of a run over checkpoint `rc` in its dtype. `targets`: the modules the recipe quantizes (the quality report copies their weights);
        with `mtp`, the multi-token-prediction layers too, which the engine runs after the last
        decoder layer when the recipe quantizes them (eprt.loading.loader.load_mtp); `gptq`:
        the modules the recipe runs GPTQ on, each with its format (eprt.quant.algorithms.gptq.layer), None
        for none; `awq`: the modules whose rule asks for AWQ's scales, each with its format."""
        hessians: dict[int, list[GPTQLinear]] | None = {} if gptq is not None else None
        rc = rc.holding(None)  # every expert: the plan divides them over the ep degree itself
        ck, dtype = rc.ck, rc.dtype
        model, stacked = checked_meta(rc), rc.stacked
        prefix, _ = model.decoder()
        reads: dict[int, list[tuple[int, int, bool, bool]]] = {}
        embedding = head = 0
        codes, largest_read = [0, 0], [0, 0]
        weights = {f"{m}.{leaf}" for m in targets for leaf in ("weight", *EXPERT_LEAVES)}
        for name, t in model.state_dict().items():
            meta = ck.meta(name)
            run_dtype = rc.run_dtype(name)
            n = t.numel() * run_dtype.itemsize
            # on its way to a GPU a tensor is read on the host, as stored (or decoded), then cast
            stored = n if meta.encoded else math.prod(meta.shape) * meta.dtype.itemsize
            largest_read[name in stacked] = max(largest_read[name in stacked], n, stored)
            m = re.match(re.escape(prefix) + r"layers\.(\d+)\.", name)
            if not m:
                embedding += n if name.startswith(prefix + "embed_tokens.") else 0
                head += n if not name.startswith(prefix + "embed_tokens.") or model.config.tie_word_embeddings else 0
                continue
            # read as stored, then cast into place: a stored copy in another dtype (or an
            # encoded one's decoded rows) is in flight beside it
            flight = n if meta.encoded else 0 if meta.dtype == run_dtype else t.numel() * meta.dtype.itemsize
            reads.setdefault(int(m.group(1)), []).append((n, flight, name in stacked, name in weights))
            # (a stacked experts' bias, [E, out], is no weight GPTQ solves)
            if gptq and ((name in stacked and t.dim() == 3) or (name.endswith(".weight") and t.dim() == 2)):
                count, out_dim, in_dim = t.shape if name in stacked else (1, *t.shape)
                linear = GPTQLinear.of(count, out_dim, in_dim, name in stacked, gptq.get(name.rpartition(".")[0]))
                hessians.setdefault(int(m.group(1)), []).append(linear)
            module, _, leaf = name.rpartition(".")
            if gptq and module in gptq and (leaf == "weight" or leaf in EXPERT_LEAVES):
                codes[name in stacked] += int(t.numel() * code_bytes(gptq[module]))
        if mtp:
            mtp_reads(rc, reads)
        cache = CPU_BF16_KERNEL_CACHE if device.type == "cpu" and dtype == torch.bfloat16 else 0
        workers = torch.get_num_threads() if device.type == "cpu" else 1
        planner = cls(
            ck, dtype, reads, embedding, cache, head, hessians, tuple(codes), tuple(largest_read), device.type, workers
        )
        return replace(planner, awq=awq_layers(model, set(targets), dict(awq))) if awq else planner

    def _gptq(self, ep: int, stack: int) -> int:
        """The most a layer's Hessians and one solve (routed experts `stack` at a time) hold on one
        rank; 0 without GPTQ."""
        most = 0
        for linears in (self.hessians or {}).values():
            held = sum(linear.held(ep) for linear in linears)
            most = max(most, held + max(linear.solve(ep, stack) for linear in linears))
        return most

    def _sized_stack(self, plan: MemoryPlan, ep: int, limit: int | None) -> MemoryPlan:
        """`plan` with GPTQ's routed experts solved as many at a time as fit in `limit` (at least one,
        at most MOST_EXPERTS_STACKED; the most where no limit is known): the one place the stack is
        sized, for the plan and the run alike."""
        if not self.hessians:
            return plan

        def stacked(stack: int) -> MemoryPlan:
            return replace(plan, gptq=self._gptq(ep, stack), expert_stack=stack)

        if limit is None:
            return stacked(MOST_EXPERTS_STACKED)
        return stacked(largest_fitting(MOST_EXPERTS_STACKED, lambda s: stacked(s).peak <= limit) or 1)

    def _awq(self, shape: RunShape) -> int:
        """What AWQ holds at most in one layer on this rank: its samples and its search; 0 without AWQ."""
        if not self.awq:
            return 0
        c, T = self.ck.config, shape.seq_len
        own = len(own_sequences(shape.num_sequences, shape.rank, shape.world)) * T
        routed = math.ceil(shape.num_sequences * T * max(c.num_experts_per_tok, 1) / shape.world)
        return sum(awq_bytes(self.awq, own, routed, T, self.dtype.itemsize, shape.ep))

    def _host(self, shape: RunShape, baseline: int, tokens: int) -> HostPlan:
        """What a GPU rank of `shape` holds in host memory; `baseline`: its resident set now."""
        dense, experts = self.largest_read
        layer = self._layer(shape.ep)[0]
        return HostPlan(baseline, tokens, max(dense, experts // shape.ep), self._codes(shape.ep), layer)

    def _codes(self, ep: int) -> int:
        """GPTQ's codes of every layer on one rank: its share of the routed experts' and every dense module's."""
        dense, experts = self.codes
        return dense + experts // ep

    def _layer(self, ep: int) -> tuple[int, int, int]:
        """(the largest layer's weights, the most any layer holds while it is read, the most a
        layer holds with the copy of its quantized weights) on one rank."""
        layer = reading = copied = 0
        for tensors in self.reads.values():
            placed = copy = 0
            for n, flight, expert, quantized in tensors:
                share = ep if expert else 1
                reading = max(reading, placed + (n + flight) // share)
                placed += n // share
                copy += n // share if quantized else 0
            layer, copied = max(layer, placed), max(copied, placed + copy)
        return layer, reading, copied

    def plan(self, shape: RunShape, baseline: int, host_baseline: int = 0, limit: int | None = None) -> MemoryPlan:
        """The plan of one rank of `shape`, whose process holds `baseline` on its device before the
        run (and on a GPU, `host_baseline` on the host), GPTQ's expert stack sized to `limit` (the
        device's memory for the rank, when known)."""
        c, b = self.ck.config, self.dtype.itemsize
        rank, world, ep = shape.rank, shape.world, shape.ep
        D, T = c.hidden_size, shape.seq_len
        per_sequence = T * c.residual_streams * D * b + self._carried(T)
        hidden = len(own_sequences(shape.num_sequences, rank, world)) * per_sequence
        layer, reading, copied = self._layer(ep)
        step = self._step(
            rank, world, shape.num_sequences, T, shape.schedule, probes=False, all_experts=shape.all_experts, ep=ep
        )
        gptq = 0  # priced with the expert stack it sizes (_sized_stack)
        awq = self._awq(shape)
        tokens = 2 * (shape.num_sequences + shape.eval_sequences) * T * 8  # int64, read then packed
        on_cpu = self.device == "cpu"
        codes, host = (self._codes(ep), None) if on_cpu else (0, self._host(shape, host_baseline, tokens))
        gpu = {} if on_cpu else {"fixed": fixed_on_gpu(world, ep), "reserve": ALLOCATOR_RESERVE}
        # the quality report's held-out streams and its head, where the run has held-out sequences
        eval_layer = eval_step = head = 0
        if shape.eval_sequences:
            hidden += 2 * len(own_sequences(shape.eval_sequences, rank, world)) * per_sequence
            if shape.search:
                hidden += 3 * len(own_sequences(shape.num_sequences, rank, world)) * per_sequence
            eval_layer = copied
            eval_step = self._step(rank, world, shape.eval_sequences, T, shape.eval_schedule, probes=True)
            # one sequence's logits of both streams: as computed, in fp32, log-softmaxed, the KL's terms
            head = self.head + T * c.vocab_size * (2 * b + 5 * 4)
        host = replace(host, saved=hidden) if host else None
        saving = hidden if on_cpu else 0  # the copy a save writes while the next layer computes
        return self._sized_stack(
            MemoryPlan(
                baseline + self.kernel_cache,
                hidden,
                self.embedding,
                layer,
                reading,
                step,
                gptq,
                awq,
                codes,
                eval_layer,
                eval_step,
                head,
                tokens,
                host,
                saving=saving,
                **gpu,
            ),
            ep,
            limit,
        )

    def _carried(self, T: int) -> int:
        """What the layers carry across layers for one sequence of T tokens: Kimi-K3's block
        snapshots, and what the family's layers leave for later ones (FamilyConfig.carried_bytes:
        GLM-5's shared top-k)."""
        c = self.ck.config
        block_size = c.kimi_linear.attn_res_block_size if c.kimi_linear else None
        snapshots = math.ceil(c.num_layers / block_size) if block_size else 0
        own = c.own.carried_bytes(T) if c.own is not None else 0
        return snapshots * T * c.hidden_size * self.dtype.itemsize + own

    def _step(
        self,
        rank: int,
        world: int,
        num_sequences: int,
        seq_len: int,
        schedule: Schedule,
        probes: bool,
        all_experts: bool = False,
        ep: int = 1,
    ) -> int:
        """One step's buffers on this rank; with `probes` (the quality report's quantized stream),
        the reference outputs its probes compute beside each quantized module's; with
        `all_experts`, the larger of the routed exchange's and the statistics pass's."""
        c, b = self.ck.config, self.dtype.itemsize
        D, T, K = c.hidden_size, seq_len, max(c.num_experts_per_tok, 1)
        n_mine = len(own_sequences(num_sequences, rank, world))
        block_size = c.kimi_linear.attn_res_block_size if c.kimi_linear else None
        # one step: this rank's share of the step's sequences (the largest share any step gives it)
        step_seqs = schedule.groups_per_step * schedule.group_size
        t = math.ceil(min(step_seqs, num_sequences) / world) * T
        W = c.routed_width  # the routed experts' width
        widest = max(c.moe.intermediate_size if c.moe else 0, c.intermediate_size)
        R = t * K if c.moe_layers else 0
        # kept until the step's exchange returns, per token: the residual and the MLP input, the
        # experts' input per sequence and concatenated
        pending = t * (2 * D + 2 * W) * b
        # one sequence's attention transients, and of a dense MLP, for each sequence run side by side
        side_by_side = max(1, min(self.workers, t // T))
        # on CPU the scores as measured; a GPU's fused kernels keep none (eprt.quant.run.device_terms)
        scores = (
            2 * c.num_heads * T * T * 4
            if self.device == "cpu"
            else attention_scores(c.num_heads, T, b, bool(c.indexer))
        )
        own = c.own.attention_bytes(T, b) if c.own is not None else 0  # a family's own (sparse attention)
        attention = (6 * T * D * b + scores + own) * side_by_side
        dense_mlp = 3 * T * widest * b * side_by_side
        # the routed copies: rows sent (and received, on more ranks), sorted, the experts'
        # activation and outputs; then the returns, gathered and widened to fp32 to combine;
        # with a handful of int64 indices per copy throughout
        moved = 3 if world == 1 else 4
        routed = R * (max(moved * W * b + widest * b, 3 * W * b + 4 * W) + 8 * 8) + t * W * 4
        if probes:  # the experts' reference rows (activation and output) of one part of the experts, and fp64 errors
            # eprt.quant.quality.expert_parts: a part's share of the rows and one expert's, at most the step's tokens
            part = min(R, math.ceil(R / REFERENCE_PARTS) + min(step_seqs, num_sequences) * T)
            routed += part * (widest * b + W * b) + R * 2 * W * 8
        if all_experts and c.moe_layers:
            routed = max(routed, self._every_expert(schedule, world, ep, num_sequences, T, t, W))
        snapshot = n_mine * T * D * b if block_size else 0
        return pending + attention + dense_mlp + routed + snapshot

    def _every_expert(self, schedule: Schedule, world: int, ep: int, num_sequences: int, T: int, t: int, W: int) -> int:
        """--calibrate-all-experts' statistics pass, which ends before the routed exchange starts:
        this rank's t tokens sent once to each of ep ranks; received, the step's tokens of the
        groups of one edp replica, and their sorted copy; then, one expert at a time, gate/up,
        the activation's temporary, the activation and its absolute value, with the input's
        absolute value beside them. A handful of int64 indices per row throughout."""
        b, I = self.dtype.itemsize, self.ck.config.moe.intermediate_size
        replica_groups = math.ceil(schedule.groups_per_step / (world // ep))
        r = min(replica_groups * schedule.group_size, num_sequences) * T
        return t * ep * (W * b + 4 * 8) + r * (2 * W * b + 3 * 8) + r * (5 * I * b + W * b)


def mtp_reads(rc: ResolvedCheckpoint, reads: dict[int, list[tuple[int, int, bool, bool]]]) -> None:
    """Each MTP layer's tensors as `Planner.reads` holds a layer's. An MTP layer is loaded whole (its
    own embedding and shared head too); its routed experts are read expert by expert from their
    source tensors and stacked, the rows in flight beside the stacked copy."""
    for spec in rc.layout.mtp:
        run_dtype = rc.run_dtype(spec.name)
        n = math.prod(spec.shape) * run_dtype.itemsize
        if spec.stacked:
            flight = n
        else:
            meta = rc.ck.meta(spec.name)
            stored = math.prod(spec.shape) * meta.dtype.itemsize
            flight = n if meta.encoded else 0 if meta.dtype == run_dtype else stored
        reads.setdefault(layer_of(spec.name), []).append((n, flight, spec.stacked, False))


def check_memory(planner: Planner, plan: MemoryPlan, limit: int, shape: RunShape, num_experts: int) -> None:
    """Refuse a plan whose peak exceeds `limit`, naming the smallest ep and the largest
    --calib-size that fit, or, where not one sequence fits, the largest --seq-len.

    It needs only the sizes, not the data: call it before the calibration data is read, so that a
    run too large for its memory is refused before it builds anything of that size."""
    if plan.peak <= limit:
        return

    def fits(**change) -> bool:
        return planner.plan(replace(shape, **change), plan.baseline, limit=limit).peak <= limit

    ways = []
    ep = fitting_ep(shape, num_experts, lambda e: fits(ep=e))
    if ep:
        ways.append(f"--ep {ep}")
    size = largest_fitting(shape.num_sequences - 1, lambda n: fits(num_sequences=n))
    if size:
        ways.append(f"--calib-size {size}")
    else:  # not even one sequence of this length fits: the length is what is too large
        length = largest_fitting(shape.seq_len - 1, lambda T: fits(seq_len=T))
        if length:
            ways.append(f"--seq-len {length}")
    way = " or ".join(ways) if ways else "more memory per rank (more ranks, a larger --ep)"
    raise ConfigError(
        f"rank {shape.rank} would peak at {format_bytes(plan.peak)} (weights of the largest layer "
        f"{format_bytes(plan.layer)}, hidden states {format_bytes(plan.hidden)}, step buffers "
        f"{format_bytes(plan.step)}, token ids {format_bytes(plan.tokens)}, process "
        f"{format_bytes(plan.baseline)}), over --max-memory {format_bytes(limit)}: use {way}"
    )


def check_host_memory(
    planner: Planner, plan: MemoryPlan, limit: int, shape: RunShape, num_experts: int, ranks_on_host: int
) -> None:
    """Refuse a GPU rank whose host plan, times the ranks that share its host, exceeds `limit`
    (the host's, for all of them), naming the smallest ep that fits. Like `check_memory`, before
    the data is read."""
    if plan.host is None or plan.host.peak * ranks_on_host <= limit:
        return
    host = plan.host

    def fits(ep: int) -> bool:
        return planner.plan(replace(shape, ep=ep), plan.baseline, host.baseline).host.peak * ranks_on_host <= limit

    ep = fitting_ep(shape, num_experts, fits)
    way = (f"--ep {ep}, or " if ep else "") + "fewer ranks on each host, or a host with more memory free"
    raise ConfigError(
        f"rank {shape.rank} would hold {format_bytes(host.peak)} of host memory ({host.terms()}); "
        f"with the {ranks_on_host} ranks on its host, {format_bytes(host.peak * ranks_on_host)}, over "
        f"--max-host-memory {format_bytes(limit)}: use {way}"
    )


def fitting_ep(shape: RunShape, num_experts: int, fits) -> int | None:
    """The smallest ep above the shape's, of the world and the experts, with fits(ep); None for none."""
    from eprt.parallel.state import valid_ep

    return next((e for e in valid_ep(shape.world, num_experts or None) if e > shape.ep and fits(e)), None)


CODE_PROBE = 128  # weights encoded to measure a format's codes: whole blocks of every format (INT4: 128)


@functools.cache
def code_bytes(fmt: str) -> float:
    """The bytes GPTQ keeps per weight of format `fmt`, as the format's own encoder writes them
    (NVFP4 packs two weights a byte, FP8 one)."""
    probe = torch.ones(1, 1, CODE_PROBE)
    return columns_of(fmt, probe, torch.ones(1)).encode(probe).nbytes / CODE_PROBE


def largest_fitting(most: int, fits) -> int:
    """The largest n in [1, most] with fits(n), 0 for none; by bisection (the peak grows with n)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
