"""The memory plan of a layer-major calibration: each rank's peak, from the manifest alone
(eprt.quant.run.planner makes it, eprt.quant.run.memory_check refuses a run it does not fit).

A rank holds, at its peak, what it held before the run (the process: interpreter, torch,
eprt; measured when the plan is made, so the plan covers it), the hidden states of its own
sequences (and what its layers carry across: Kimi-K3's block snapshots, GLM-5's shared top-k),
and the larger of: the embedding table while the first hidden states are formed, or one decoder
layer's weights with one step's buffers (the activations of the sequences whose dense parts run
side by side, the routed copies sent, received, sorted and returned, the experts' intermediate
rows, the fp32 combine; with --calibrate-all-experts, the larger of those and the statistics
pass's) and the largest tensor in flight as it is read.

Each calibration algorithm prices what it holds itself (`AlgorithmMemory`, made in its own module):
what it holds in one layer while it works, beside the layer's weights and a step (the algorithms of
a layer work in turn, so the largest of them counts), and what it keeps until the output is written.

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
attention keeps no T x T scores. It holds host memory too, planned apart and checked against the host's
own limit: the process, the token ids, a tensor as it is read before it moves to the device, the next
layer read ahead while one computes (eprt.quant.loop.read_ahead), the hidden states as a save copies
them to the host (eprt.quant.run.workdir: written while the next layer computes), and what the algorithms keep to the output's writing, which
moves to the host as each layer is done. On a CPU rank the host is the device, and those terms are in
its one plan.
"""

from __future__ import annotations

from dataclasses import dataclass

from eprt.quant.loop.sequences import Schedule
from eprt.units import format_bytes


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


class AlgorithmMemory:
    """What one calibration algorithm holds in a run, as its own module prices it (made from the
    meta model by the algorithm's `memory`; eprt.quant.algorithms.base)."""

    name = ""
    most_stacked = 0  # routed experts it works on at once, as many as the memory allows up to this (0: none)
    kept_what = ""  # what it keeps to the output's writing, for the plan's summary

    def held(self, shape: RunShape, stack: int) -> int:
        """The most it holds in one layer on rank `shape.rank`, beside the layer's weights and a
        step, working on routed experts `stack` at a time."""
        return 0

    def kept(self, ep: int) -> int:
        """What one rank of ep `ep` keeps until the output is written."""
        return 0

    def terms(self, held: int, stack: int) -> str:
        """Its part of the plan's summary: 'AWQ's samples and search 12.0 MiB'."""
        return ""


@dataclass(frozen=True)
class AlgorithmTerm:
    """One algorithm's part of a plan."""

    name: str
    held: int  # in one layer while it works (the algorithms of a layer work in turn)
    kept: int  # until the output is written: on a CPU rank in its one plan, on a GPU rank in the host's
    text: str  # its terms for the summary


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
    algorithms: tuple[AlgorithmTerm, ...] = ()  # each algorithm's own terms (AlgorithmMemory)
    eval_layer: int = 0  # the quality report: the largest layer's weights with the copy of its quantized ones
    eval_step: int = 0  # one held-out step's buffers, with the probes'
    head: int = 0  # the final norm and the head with one sequence's logits, after the last layer
    tokens: int = 0  # the calibration (and held-out) token ids, as read and as packed into sequences
    host: HostPlan | None = None  # on a GPU rank, what it holds in host memory; None on CPU (the host is the device)
    # on CPU: a save's copy of the hidden states, written while the next layer computes (on a GPU: `host.saved`)
    saving: int = 0
    expert_stack: int = 0  # routed experts an algorithm works on at once (the run takes it from here); 0: none does
    # on a GPU (eprt.quant.run.device_terms): the CUDA context, cuBLAS's workspaces and NCCL's buffers, and
    # the caching allocator's reserve above the allocated peak, as a share of it
    fixed: int = 0
    reserve: float = 0.0

    @property
    def peak(self) -> int:
        return self.allocated + int(self.allocated * self.reserve) + self.fixed

    @property
    def held(self) -> int:
        """The most any algorithm holds in a layer."""
        return max((a.held for a in self.algorithms), default=0)

    @property
    def kept(self) -> int:
        """What the algorithms keep to the output's writing on the device (a GPU's is the host's)."""
        return 0 if self.host is not None else sum(a.kept for a in self.algorithms)

    @property
    def allocated(self) -> int:
        """The peak of what torch allocates: on a GPU, the allocator's allocated high-water mark."""
        return (
            self.baseline
            + self.hidden
            + self.saving
            + self.tokens
            + self.kept
            + max(
                self.embedding,
                self.reading,
                self.layer + self.step + self.held,
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
        text += "".join(f", {a.text}" for a in self.algorithms if a.text)
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
    kept: tuple[tuple[str, int], ...] = ()  # what each algorithm keeps to the output's writing: (what, bytes)
    ahead: int = 0  # the next layer's share, read ahead while one computes (eprt.quant.loop.read_ahead)
    saved: int = 0  # a save's copy of the hidden states (and streams), written to the work directory

    @property
    def peak(self) -> int:
        return self.baseline + self.tokens + self.reading + self.ahead + self.saved + sum(n for _, n in self.kept)

    def terms(self) -> str:
        return (
            f"process {format_bytes(self.baseline)}, token ids {format_bytes(self.tokens)}, a tensor as read "
            f"{format_bytes(self.reading)}, the next layer read ahead {format_bytes(self.ahead)}, a save's copy of "
            f"the hidden states {format_bytes(self.saved)}"
        ) + "".join(f", {what} {format_bytes(n)}" for what, n in self.kept)
