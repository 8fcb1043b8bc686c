"""What GPTQ holds in a run, for the memory plan (eprt.quant.run.memory_plan.AlgorithmMemory).

- In a layer, beside its weights: every Linear's Hessian (int64 sums; a routed experts' weight: its
  experts', a rank holding its share; under `quantized_inputs` a cross sum of the same size beside it), and one solve's working set at a time: the weight as read for
  it in fp32 (a routed experts' weight: every expert of the rank's, the stacks are cut from them), the
  fp64 inverse factor, W in fp64 with its working block, the fp32 result and the column rounding's
  tables of its format, routed experts solved `stack` at a time, and beside it, for a moment, the
  factoring of one Hessian (the fp64 Hessian, its Cholesky factor, the inverse and its factor:
  eprt.quant.algorithms.gptq.solve._inverse_factor). Every 2-D weight of a layer is counted (an upper
  bound: not every one is quantized); an MTP layer is a decoder layer's size.
- To the output's writing: the codes of every module it rounds, in its format's encoding (NVFP4 packs
  two weights a byte, FP8 takes one), a rank holding its share of the routed experts'; on a GPU they
  move to the host as each layer is rounded."""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping, Set
from dataclasses import dataclass

import torch
from torch import nn

from eprt.layout import EXPERT_LEAVES
from eprt.loading.resolved import ResolvedCheckpoint
from eprt.quant.algorithms.gptq.layer import ALGORITHM, MOST_EXPERTS_STACKED
from eprt.quant.algorithms.gptq.solve import columns_held_bytes, columns_of
from eprt.quant.run.memory_plan import AlgorithmMemory, RunShape
from eprt.units import format_bytes

CODE_PROBE = 128  # weights encoded to measure a format's codes: whole blocks of every format (INT4: 128)


@dataclass(frozen=True)
class GPTQLinear:
    """What GPTQ holds for one Linear of a layer (a routed experts' weight: all its experts)."""

    hessian: int  # the int64 sums of all its experts
    weight: int  # one weight as read for the solve, in fp32
    weight_solve: int  # what one weight's solve holds for its whole length
    factoring: int  # what factoring one Hessian holds for a moment beside the solve
    experts: int  # its routed experts; 0 for a dense Linear

    @classmethod
    def of(
        cls, count: int, out_dim: int, in_dim: int, routed: bool, fmt: str | None = None, sums: int = 1
    ) -> GPTQLinear:
        """`sums`: the int64 sums each weight keeps (2 under quantized_inputs: the Hessian and the cross sum)."""
        square = in_dim * in_dim * 8
        solve = square + 3 * out_dim * in_dim * 8 + (columns_held_bytes(fmt, out_dim, in_dim) if fmt else 0)
        return cls(sums * count * square, out_dim * in_dim * 4, solve, 4 * square, count if routed else 0)

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
class GPTQMemory(AlgorithmMemory):
    hessians: dict[int, list[GPTQLinear]]  # per decoder layer, its Linears'
    codes: tuple[int, int]  # the codes of the modules it rounds: (dense bytes, routed experts' bytes)
    name = ALGORITHM
    most_stacked = MOST_EXPERTS_STACKED
    kept_what = "GPTQ's codes"

    @classmethod
    def of(
        cls, rc: ResolvedCheckpoint, model: nn.Module, modules: Mapping[str, str], cross: Set[str] = frozenset()
    ) -> GPTQMemory:
        """Of meta model `model` of `rc` (every expert), GPTQ running on `modules` (each with its
        format), those in `cross` under quantized_inputs."""
        prefix, _ = model.decoder()
        stacked = rc.stacked
        hessians: dict[int, list[GPTQLinear]] = {}
        codes = [0, 0]
        for name, t in model.state_dict().items():
            m = re.match(re.escape(prefix) + r"layers\.(\d+)\.", name)
            if not m:
                continue
            routed = name in stacked and t.dim() == 3  # a stacked experts' bias, [E, out], is no weight GPTQ solves
            module, _, leaf = name.rpartition(".")
            if routed or (leaf == "weight" and t.dim() == 2):
                count, out_dim, in_dim = t.shape if routed else (1, *t.shape)
                sums = 2 if module in cross else 1
                linear = GPTQLinear.of(count, out_dim, in_dim, routed, modules.get(module), sums)
                hessians.setdefault(int(m.group(1)), []).append(linear)
            if module in modules and (leaf == "weight" or leaf in EXPERT_LEAVES):
                codes[routed] += int(t.numel() * code_bytes(modules[module]))
        return cls(hessians, (codes[0], codes[1]))

    def held(self, shape: RunShape, stack: int) -> int:
        """The most a layer's Hessians and one solve (routed experts `stack` at a time) hold on one rank."""
        most = 0
        for linears in self.hessians.values():
            held = sum(linear.held(shape.ep) for linear in linears)
            most = max(most, held + max(linear.solve(shape.ep, stack) for linear in linears))
        return most

    def kept(self, ep: int) -> int:
        """Its codes of every layer on one rank: its share of the routed experts' and every dense module's."""
        dense, experts = self.codes
        return dense + experts // ep

    def terms(self, held: int, stack: int) -> str:
        return f"GPTQ's Hessians {format_bytes(held)} (experts solved {stack} at a time)"


@functools.cache
def code_bytes(fmt: str) -> float:
    """The bytes GPTQ keeps per weight of format `fmt`, as the format's own encoder writes them
    (NVFP4 packs two weights a byte, FP8 one)."""
    probe = torch.ones(1, 1, CODE_PROBE)
    return columns_of(fmt, probe, torch.ones(1)).encode(probe).nbytes / CODE_PROBE
