"""GPTQ as a registered algorithm: its memory (eprt.quant.algorithms.gptq.plan: Hessians, solves, codes), its run
state (eprt.quant.algorithms.gptq.layer.GPTQRun: the codes so far, saved at each layer boundary and recorded
in the calibrated checkpoint), its pass (eprt.quant.algorithms.gptq.passes) and its summary."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from eprt.loading.resolved import ResolvedCheckpoint
from eprt.quant.algorithms.base import Algorithm, RunContext
from eprt.quant.algorithms.gptq.layer import ALGORITHM, GPTQRun
from eprt.quant.algorithms.gptq.passes import GPTQ
from eprt.quant.algorithms.gptq.plan import GPTQMemory
from eprt.quant.algorithms.gptq.record import GPTQRecord
from eprt.quant.loop.engine import Pass


class GPTQAlgorithm(Algorithm):
    name = ALGORITHM

    def memory(self, rc, model, targets, modules: Mapping[str, str], device, params) -> GPTQMemory:
        return GPTQMemory.of(rc, model, modules, {m for m, p in params.items() if p.quantized_inputs})

    def start(self, ctx: RunContext, viewed) -> GPTQRun:
        return GPTQRun(
            ctx.state,
            ctx.rc,
            ctx.recipe,
            ctx.targets,
            tokens=ctx.tokens,
            min_tokens=ctx.options.min_tokens,
            expert_stack=ctx.expert_stack,
        )

    def passes(self, ctx: RunContext, run: GPTQRun, rounds_after: bool) -> list[Pass]:
        return [GPTQ(run, ctx.cal)]

    def saved(self, run: GPTQRun) -> dict[str, torch.Tensor]:
        return run.results.tensors(run.results.modules())

    def restore(self, run: GPTQRun, tensors: dict[str, torch.Tensor]) -> None:
        run.results.load(tensors)

    def record(self, run: GPTQRun) -> GPTQRecord:
        return GPTQRecord(run.results.dense, run.results.experts)

    def apply(self, run: GPTQRun, model: nn.Module, rc: ResolvedCheckpoint, experts, device) -> set[str]:
        return run.results.apply(model, rc.ck, run.formats, experts[0] if experts else 0)

    def summary(self, run: GPTQRun, ctx: RunContext) -> dict:
        return {"gptq_min_tokens": ctx.options.min_tokens, "gptq_skipped_experts": run.results.summary()}
