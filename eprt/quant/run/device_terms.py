"""What a GPU rank's memory holds beside torch's allocations, and what attention keeps per sequence.

The plan (eprt.quant.run.memory_plan) counts what torch allocates. A GPU also holds, outside the allocator:
- the CUDA context: the driver's state and the kernels of torch, Triton and cuBLAS loaded on it
  (with CUDA's lazy loading, those a run calls);
- NCCL's buffers: each communicator keeps, for each peer it exchanges with, send and receive
  buffers on a few channels, so they grow with the peers (the world's, the ep group's and the edp
  group's communicators are all used);
and the caching allocator reserves more than is allocated: freed blocks stay cached for reuse, and
blocks are rounded up and split, so the reserved peak stands above the allocated one.

and cuBLAS's workspaces (cuBLAS's and cuBLASLt's for the run's stream), which torch allocates once
and keeps. These terms are priors, not readings: `make gpu-quick`'s memory step measures
the allocated and reserved peaks and what lies outside the allocator, against the plan
(docs/gpu-check.md), and they are to be set from its figures.

Attention on a GPU runs in SDPA's fused kernels (flash, or the memory-efficient one where the value
head is narrower than the query's, as in MLA): they keep one fp32 log-sum-exp per head and query,
never the T x T scores. An explicit mask (DeepSeek-V3.2's sparse attention) is a [T, T] boolean,
widened to the dtype as the kernel's additive bias.
"""

from __future__ import annotations

CUDA_CONTEXT = 768 * 2**20
CUBLAS_WORKSPACES = 64 * 2**20  # cuBLAS's and cuBLASLt's, 32 MiB each on Hopper
NCCL_PER_PEER = 32 * 2**20  # 2 buffers x 4 channels x NCCL_BUFFSIZE (4 MiB) with each peer
ALLOCATOR_RESERVE = 0.10  # reserved above allocated, as a share of the allocated peak


def fixed_on_gpu(world: int, ep: int) -> int:
    """The bytes a GPU rank of a world of `world` at `ep` holds for the whole run beside the plan's
    terms: the CUDA context, cuBLAS's workspaces and the buffers of its NCCL communicators (none in a
    world of one)."""
    peers = (world - 1) + (ep - 1) + (world // ep - 1) if world > 1 else 0  # the world's, ep's, edp's
    return CUDA_CONTEXT + CUBLAS_WORKSPACES + peers * NCCL_PER_PEER


def attention_scores(heads: int, seq_len: int, itemsize: int, masked: bool) -> int:
    """What SDPA's fused kernels keep for one sequence beside q, k, v and the output: a log-sum-exp per
    head and query; with an explicit mask, the mask and its additive bias."""
    kept = heads * seq_len * 4
    return kept + (seq_len * seq_len * (1 + itemsize) if masked else 0)
