"""The routed experts' calibration coverage: how many tokens the router sent each expert of each MoE
layer, over every rank, said after calibration (`report_coverage`) and written into the quality
report (`starved_experts`), with what was done for the experts no token reached."""

from __future__ import annotations

import torch
import torch.distributed as dist

from eprt.parallel import ParallelState
from eprt.progress import logger
from eprt.quant.algorithms.registry import expert_notes
from eprt.quant.loop.calibrate import Calibrator


def report_coverage(
    cal: Calibrator, state: ParallelState, num_experts: int
) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Rank 0 prints, per MoE layer, the tokens the router sent each expert and the experts none
    reached; with --calibrate-all-experts, also the tokens each expert saw for statistics only.
    Returns both counts per MoE module, on every rank."""
    log = logger()
    counts = {}
    for module, tokens in cal.expert_tokens.items():
        full = every_expert(tokens, state, num_experts)
        seen = every_expert(cal.expert_all_tokens[module], state, num_experts) if cal.all_experts else None
        counts[module] = full, seen
        if state.rank != 0:
            continue
        unreached = (full == 0).nonzero().view(-1).tolist()
        if seen is not None:
            unreached_note = f"; the router sent no token to experts {unreached}" if unreached else ""
            log.info(
                "%s: routed tokens per expert min %d / median %d / max %d%s; all-experts statistics: "
                "tokens per expert min %d / max %d",
                module,
                int(full.min()),
                int(full.median()),
                int(full.max()),
                unreached_note,
                int(seen.min()),
                int(seen.max()),
            )
            continue
        log.info(
            "%s: tokens per expert min %d / median %d / max %d%s",
            module,
            int(full.min()),
            int(full.median()),
            int(full.max()),
            f"; no token reached experts {unreached} (they get the layer's input scale; "
            "--calibrate-all-experts calibrates them)"
            if unreached
            else "",
        )
    return counts


def starved_experts(coverage: dict[str, tuple[torch.Tensor, torch.Tensor | None]], summary: dict) -> list[dict]:
    """Per MoE module, for the quality report: the calibration tokens the router sent each expert,
    those --calibrate-all-experts gave it, and what was done for the experts that starved (each
    algorithm's own lists, from its summary entry: eprt.quant.algorithms.registry.expert_notes)."""
    notes = {key: summary.get(entry, {}) for key, entry in expert_notes().items()}
    out = []
    for module, (full, seen) in coverage.items():
        unreached = (full == 0).nonzero().view(-1).tolist()
        out.append(
            {
                "module": module,
                "tokens": full.tolist(),
                "all_experts_tokens": None if seen is None else seen.tolist(),
                "unreached": unreached,
                **{key: listed.get(module, []) for key, listed in notes.items()},
                "unreached_handling": ""
                if not unreached
                else "calibrated on every token of the layer (--calibrate-all-experts)"
                if seen is not None
                else "the layer's input scale (no token reached them; --calibrate-all-experts calibrates them)",
            }
        )
    return out


def every_expert(rows: torch.Tensor, state: ParallelState, num_experts: int) -> torch.Tensor:
    """A per-expert count of this rank's experts (reduced over edp) as one for all of them, on every rank."""
    first = state.placement(num_experts).first
    full = torch.zeros(num_experts, dtype=torch.int64, device=rows.device)
    full[first : first + rows.shape[0]] = rows
    return state.all_reduce(full, over="ep", op=dist.ReduceOp.SUM).cpu()
