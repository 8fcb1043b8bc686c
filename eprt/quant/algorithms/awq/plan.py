"""What AWQ holds per decoder layer, for the memory plan (eprt.quant.run.memory_plan.AlgorithmMemory): the calibration inputs
its balanced groups keep from the statistics run to the search (eprt.quant.algorithms.awq.passes), and the
search's working set.

- Samples: per token of this rank's calibration sequences, the input of each balanced group's
  first dense reader (the attention input, v -> o's, the MoE input as the router reads it, a dense
  MLP's activation); per routed copy this rank's experts compute, its input and its activation
  (where a group of the routed experts is balanced). The routed copies are priced at an even share
  of the routing: num_sequences x seq_len x top-k / world.
- The clips (eprt.quant.algorithms.awq.clip): a uint8 step per quantization block of every balanced quantized
  weight, held as folds to the end of the run: every dense module's on every rank (1/32 of the
  bytes of the bf16 dense weights, which every rank holds whole anyway), and of the routed experts
  only this rank's (eprt.quant.algorithms.awq.folds.HELD_PER_RANK);
  counted at NVFP4's blocks of 16, the smallest a clipped format has (none where the format does
  not clip).
  The clip search's working set (every step of a chunk of rows, eprt.quant.algorithms.awq.clip.CHUNK_ELEMENTS,
  in fp32 and fp64) comes after the scale search's: the larger of the two counts.
- The search: one reader's candidates at a time (a round's scales of its weight, fake-quantized in
  fp32 and held as [A, in, out], with one candidate's temporaries, or every candidate's where one
  call quantizes them all), the candidates of one batch of scored rows in the input dtype, one
  unit's outputs, and the group's readers' reference outputs on every scored row (fp32), made in
  the search's first round and kept to its last.
- The folds, read back into the layer through the folded checkpoint (eprt.quant.algorithms.awq.folds.fold), after
  the scale search and again after the clips: the largest tensor a fold rewrites (a routed experts'
  stacked projections: this rank's experts'), as read and folded in its dtype and, at once, in fp32 its
  scaled weight, the clip's blocks and their bounds (FOLD_FP32_COPIES). The first read comes while
  the samples are held: the larger of it, the search and the clip search counts beside them.
  On a CPU rank the fold comes beside what the two searches held, too: their working sets are freed
  in pieces below glibc's mmap threshold (which rises, up to 32 MiB, to the largest block freed), so
  the process's heap keeps them for reuse, while the fold's larger tensors are mapped afresh beside it
  (measured on the memory test's model, 1.12 GiB where the fold alone was planned at 0.94; 0.90 GiB with
  MALLOC_MMAP_THRESHOLD_ set low, which gives every freed block back). A GPU's allocator reuses them,
  and its reserve is priced apart (eprt.quant.run.device_terms)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from torch import nn

from eprt.loading.resolved import ResolvedCheckpoint
from eprt.models.moe import Experts
from eprt.quant.algorithms.awq.clip import CHUNK_ELEMENTS as CLIP_CHUNK_ELEMENTS
from eprt.quant.algorithms.awq.clip import MOST_STEPS as CLIP_STEPS
from eprt.quant.algorithms.awq.groups import layer_groups
from eprt.quant.algorithms.awq.passes import NAME
from eprt.quant.algorithms.awq.search import BATCH_ELEMENTS, COARSE, SCORED_ROWS, candidates_at_once
from eprt.quant.formats import weight_format
from eprt.quant.formats.nvfp4 import BLOCK_SIZE as SMALLEST_CLIP_BLOCK
from eprt.quant.loop.sequences import own_sequences
from eprt.quant.run.memory_plan import AlgorithmMemory, RunShape
from eprt.units import format_bytes

FOLD_FP32_COPIES = 3  # a fold's fp32 tensors at once: the scaled weight, the clip's blocks and their bound


@dataclass(frozen=True)
class AWQLayer:
    dense_width: int  # per token: the summed input widths of the balanced groups' first dense readers
    routed_width: int  # per routed copy: its input and activation widths, where the routed experts are balanced
    largest: int  # the most elements of one quantized reader the search scores (a routed expert's: one expert's)
    largest_at_once: int  # the same, of the readers whose format quantizes every candidate in one call
    widest: int  # the widest input the search quantizes
    outputs: int = 0  # the most output width of a group's quantized readers together: their kept references
    dense_clips: int = 0  # the clips' steps of its balanced dense readers, in bytes (uint8 a block)
    routed_clips: int = 0  # those of its balanced routed experts, every expert's (a rank holds its share)
    folded_dense: int = 0  # the most elements of one dense tensor a fold rewrites (a reader's weight)
    folded_routed: int = 0  # the same of the routed experts' stacked tensors, every expert's (a rank reads its share)


def awq_layers(model: nn.Module, targets: set[str], balanced: dict[str, str]) -> dict[int, AWQLayer]:
    """Per decoder layer of `model` (a meta model), what AWQ keeps for the groups it balances: those
    with a quantized reader (in `targets`), every one of them in `balanced` (AWQ._balanced's rule;
    module -> its format)."""
    prefix, decoder = model.decoder()
    out = {}
    for i, layer in enumerate(decoder.layers):
        dense = routed = largest = at_once = widest = outputs = dense_clips = routed_clips = 0
        folded_dense = folded_routed = 0
        for g in layer_groups(layer, f"{prefix}layers.{i}.")[0]:
            quantized = [m for m, _ in g.readers if m in targets]
            if not quantized or not all(m in balanced for m in quantized):
                continue
            first = model.get_submodule(g.readers[0][0])
            for m, _ in g.readers:  # every reader's weight is folded, quantized or not (the router)
                module = model.get_submodule(m)
                if isinstance(module, Experts):
                    folded_routed = max(folded_routed, module.w_in.numel(), module.w_out.numel())
                else:
                    folded_dense = max(folded_dense, module.weight.numel())
            width = 0
            for m in quantized:
                module = model.get_submodule(m)
                if isinstance(module, Experts):
                    routed = module.w_in.shape[2] + module.w_out.shape[2]
                    w = module.w_out[0] if g.per_expert else module.w_in[0]
                    routed_clips += (module.w_out if g.per_expert else module.w_in).numel() // SMALLEST_CLIP_BLOCK
                else:
                    w = module.weight
                    dense_clips += w.numel() // SMALLEST_CLIP_BLOCK
                largest, widest = max(largest, w.numel()), max(widest, w.shape[1])
                if candidates_at_once(weight_format(balanced[m])):
                    at_once = max(at_once, w.numel())
                width += w.shape[0]  # a gated MLP's reference is its activation: half its gate and up
            outputs = max(outputs, width)
            if not isinstance(first, Experts):
                dense += first.weight.shape[1]
        if dense or routed:
            out[i] = AWQLayer(
                dense, routed, largest, at_once, widest, outputs, dense_clips, routed_clips, folded_dense, folded_routed
            )
    return out


def awq_bytes(
    layers: dict[int, AWQLayer],
    own_tokens: int,
    routed_copies: int,
    seq_len: int,
    itemsize: int,
    ep: int,
    heap_keeps: bool = False,
) -> tuple[int, int, int]:
    """(the samples, the search's working set) of the layer that holds the most, and every layer's
    clips this rank holds, in bytes: this rank holding `own_tokens` calibration tokens, computing
    `routed_copies` routed copies, in `itemsize`-byte activations, and a share of the routed
    experts at expert parallelism `ep`; with `heap_keeps` (a CPU rank), the fold beside what the
    searches freed before it."""
    A = len(COARSE)  # the most candidates the search holds at once
    scored = math.ceil(seq_len / max(1, seq_len // SCORED_ROWS))  # a sequence's rows the search scores
    most = (0, 0)
    for layer in layers.values():
        samples = (own_tokens * layer.dense_width + routed_copies * layer.routed_width) * itemsize
        rows = max(own_tokens // max(seq_len, 1) * scored, min(routed_copies, own_tokens))
        inputs = min(BATCH_ELEMENTS, A * rows * layer.widest) * itemsize
        # a reader's candidates, and beside them one candidate's fold and quantization in fp32, or
        # every candidate's where the format quantizes them in one call (awq_search.fake_weights:
        # their folds, the codes' values and those scaled, in fp32 at most)
        weights = max((A + 3) * layer.largest, (A + 3 * A) * layer.largest_at_once) * 4
        # one unit's scored rows: its candidates in fp32 and their outputs, at most about 2 x SCORED_ROWS rows
        unit = 2 * A * 2 * SCORED_ROWS * (layer.widest + layer.largest // layer.widest) * 4
        # every scored row's reference outputs of the group's readers, fp32, kept through the rounds
        inputs += rows * layer.outputs * 4
        # the clip search, after it: a chunk of rows' every step, clipped (fp32 and the weight's
        # dtype), quantized (fp32), its error and the error's product with the Hessian blocks (fp64)
        clip = min(CLIP_CHUNK_ELEMENTS, CLIP_STEPS * layer.largest) * (4 + itemsize + 4 + 8 + 8)
        # the fold of the largest tensor it rewrites, as read back into the layer
        fold = max(layer.folded_dense, layer.folded_routed // ep) * (2 * itemsize + FOLD_FP32_COPIES * 4)
        search = inputs + weights + unit
        fold += search + clip if heap_keeps else 0
        most = max(most, (samples, max(search, clip, fold)), key=sum)
    # the clips stay to the end of the run: at the last layer, every layer's (its routed experts' on
    # their ranks, ep of them sharing the experts evenly)
    return (*most, sum(layer.dense_clips + layer.routed_clips // ep for layer in layers.values()))


@dataclass(frozen=True)
class AWQMemory(AlgorithmMemory):
    layers: dict[int, AWQLayer]
    top_k: int  # routed copies per token
    itemsize: int  # the run's activations
    on_cpu: bool  # the fold comes beside the searches' freed working sets (the heap keeps them)
    name = NAME

    @classmethod
    def of(cls, rc: ResolvedCheckpoint, model: nn.Module, targets, modules: Mapping[str, str], on_cpu: bool):
        """Of meta model `model` of `rc`, AWQ balancing `modules` (each with its format) of `targets`."""
        layers = awq_layers(model, set(targets), dict(modules))
        return cls(layers, max(rc.ck.config.num_experts_per_tok, 1), rc.dtype.itemsize, on_cpu)

    def held(self, shape: RunShape, stack: int) -> int:
        """Its samples, its search and every layer's clips, on rank `shape.rank`: the routed copies at
        an even share of the routing."""
        T = shape.seq_len
        own = len(own_sequences(shape.num_sequences, shape.rank, shape.world)) * T
        routed = math.ceil(shape.num_sequences * T * self.top_k / shape.world)
        return sum(awq_bytes(self.layers, own, routed, T, self.itemsize, shape.ep, self.on_cpu))

    def terms(self, held: int, stack: int) -> str:
        return f"AWQ's samples and search {format_bytes(held)}"
