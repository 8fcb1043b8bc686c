"""The memory planner: a run's weight terms read from the manifest once (`Planner.of`), then any
layout and data size priced (`Planner.plan`) into a MemoryPlan (eprt.quant.run.memory_plan, which
says what each term holds), each algorithm's own terms (its AlgorithmMemory) among them."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from eprt.layout import EXPERT_LEAVES
from eprt.loading.loader import checked_meta
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.quant.loop.sequences import Schedule, own_sequences
from eprt.quant.quality import REFERENCE_PARTS
from eprt.quant.run.device_terms import ALLOCATOR_RESERVE, attention_scores, fixed_on_gpu
from eprt.quant.run.memory_plan import AlgorithmMemory, AlgorithmTerm, HostPlan, MemoryPlan, RunShape
from eprt.storage.checkpoint import Checkpoint
from eprt.units import format_bytes

# What bf16 matmuls on CPU keep once a layer has run: oneDNN's cached primitives (one per
# shape it was given; unit rows come padded to a few dozen shapes) and the allocator's arenas.
# Measured on the bench model (hidden 1024, 32 experts), 60-100 MiB; fp32 goes to MKL, which
# keeps nothing.
CPU_BF16_KERNEL_CACHE = 64 * 2**20


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
    largest_read: tuple[int, int] = (0, 0)  # the largest tensor as stored: (dense bytes, routed experts' bytes)
    device: str = "cpu"
    # sequences whose dense parts run side by side: on CPU one a worker thread (the engine's
    # eprt.kernels.cpu_workers, as many as torch's threads)
    workers: int = 1
    algorithms: tuple[AlgorithmMemory, ...] = ()  # what each algorithm of the run holds of its own

    @classmethod
    def of(
        cls,
        rc: ResolvedCheckpoint,
        device: torch.device,
        targets=(),
        mtp: bool = False,
        algorithms: Sequence[Callable[[ResolvedCheckpoint, nn.Module], AlgorithmMemory | None]] = (),
    ) -> Planner:
        """The plan of a run over checkpoint `rc` in its dtype. `targets`: the modules the recipe
        quantizes (the quality report copies their weights); with `mtp`, the multi-token-prediction
        layers too, which the engine runs after the last decoder layer when the recipe quantizes
        them (eprt.loading.loader.load_mtp); `algorithms`: each algorithm's memory, made from the
        checkpoint (every expert) and its meta model (eprt.quant.algorithms.program.Program.planner)."""
        rc = rc.holding(None)  # every expert: the plan divides them over the ep degree itself
        ck, dtype = rc.ck, rc.dtype
        model, stacked = checked_meta(rc), rc.stacked
        prefix, _ = model.decoder()
        reads: dict[int, list[tuple[int, int, bool, bool]]] = {}
        embedding = head = 0
        largest_read = [0, 0]
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
        if mtp:
            mtp_reads(rc, reads)
        cache = CPU_BF16_KERNEL_CACHE if device.type == "cpu" and dtype == torch.bfloat16 else 0
        workers = torch.get_num_threads() if device.type == "cpu" else 1
        memories = tuple(m for m in (memory(rc, model) for memory in algorithms) if m is not None)
        return cls(ck, dtype, reads, embedding, cache, head, tuple(largest_read), device.type, workers, memories)

    def _algorithms(self, shape: RunShape, stack: int, on_host: bool) -> tuple[AlgorithmTerm, ...]:
        """Each algorithm's part of the plan of `shape`, routed experts worked on `stack` at a time."""
        out = []
        for a in self.algorithms:
            held, kept = a.held(shape, stack), a.kept(shape.ep)
            text = a.terms(held, stack)
            if kept and not on_host:
                text += f", {a.kept_what} {format_bytes(kept)}"
            out.append(AlgorithmTerm(a.name, held, kept, text))
        return tuple(out)

    def _sized_stack(self, plan: MemoryPlan, shape: RunShape, limit: int | None) -> MemoryPlan:
        """`plan` with the algorithms' routed experts worked on as many at a time as fit in `limit` (at
        least one, at most the most any algorithm stacks; that most where no limit is known): the one
        place the stack is sized, for the plan and the run alike."""
        most = max((a.most_stacked for a in self.algorithms), default=0)

        def stacked(stack: int) -> MemoryPlan:
            return replace(plan, algorithms=self._algorithms(shape, stack, plan.host is not None), expert_stack=stack)

        if not most or limit is None:
            return stacked(most)
        return stacked(largest_fitting(most, lambda s: stacked(s).peak <= limit) or 1)

    def _host(self, shape: RunShape, baseline: int, tokens: int) -> HostPlan:
        """What a GPU rank of `shape` holds in host memory; `baseline`: its resident set now."""
        dense, experts = self.largest_read
        layer = self._layer(shape.ep)[0]
        kept = tuple((a.kept_what, a.kept(shape.ep)) for a in self.algorithms if a.kept(shape.ep))
        return HostPlan(baseline, tokens, max(dense, experts // shape.ep), kept, ahead=layer)

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
        run (and on a GPU, `host_baseline` on the host), the algorithms' expert stack sized to `limit`
        (the device's memory for the rank, when known)."""
        c, b = self.ck.config, self.dtype.itemsize
        rank, world, ep = shape.rank, shape.world, shape.ep
        D, T = c.hidden_size, shape.seq_len
        per_sequence = T * c.residual_streams * D * b + self._carried(T)
        hidden = len(own_sequences(shape.num_sequences, rank, world)) * per_sequence
        layer, reading, copied = self._layer(ep)
        step = self._step(
            rank, world, shape.num_sequences, T, shape.schedule, probes=False, all_experts=shape.all_experts, ep=ep
        )
        tokens = 2 * (shape.num_sequences + shape.eval_sequences) * T * 8  # int64, read then packed
        on_cpu = self.device == "cpu"
        host = None if on_cpu else self._host(shape, host_baseline, tokens)
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
        plan = MemoryPlan(
            baseline + self.kernel_cache,
            hidden,
            self.embedding,
            layer,
            reading,
            step,
            eval_layer=eval_layer,
            eval_step=eval_step,
            head=head,
            tokens=tokens,
            host=host,
            saving=saving,
            **gpu,
        )
        return self._sized_stack(plan, shape, limit)

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
    """Each MTP layer's tensors as `Planner.reads` holds a layer's (MTP layer k as layer
    num_hidden_layers + k). An MTP layer is loaded whole (its own embedding and shared head too, or
    the model's it shares: `Family.mtp_shared`); its routed experts are read expert by expert from
    their source tensors and stacked, the rows in flight beside the stacked copy."""
    c = rc.ck.config
    shared = [s for s in rc.layout.specs if s.name in rc.family.mtp_shared]
    for k in range(c.num_nextn_predict_layers):
        prefix = rc.family.mtp_layer(c, k)
        for spec in [s for s in rc.layout.mtp if s.name.startswith(prefix)] + shared:
            reads.setdefault(c.num_layers + k, []).append(mtp_read(rc, spec))


def mtp_read(rc: ResolvedCheckpoint, spec) -> tuple[int, int, bool, bool]:
    """One MTP tensor's read as `Planner.reads` holds it: (bytes placed, bytes in flight, stacked, a weight)."""
    run_dtype = rc.run_dtype(spec.name)
    n = math.prod(spec.shape) * run_dtype.itemsize
    if spec.stacked:
        return n, n, True, False
    meta = rc.ck.meta(spec.name)
    stored = math.prod(spec.shape) * meta.dtype.itemsize
    return n, n if meta.encoded else 0 if meta.dtype == run_dtype else stored, False, False


def largest_fitting(most: int, fits) -> int:
    """The largest n in [1, most] with fits(n), 0 for none; by bisection (the peak grows with n)."""
    lo, hi = 0, most
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo
