"""Max calibration: the abs-max of every quantized module's input, and of the KV cache.

Dense modules record one amax per module; each rank's routed experts record one amax per
expert and per projection (gate/up read the expert's input, down reads the gated activation),
from exactly the tokens routed to that expert, plus how many tokens each expert received.
With --calibrate-all-experts the layer-major engine also runs every token through every expert
for statistics only, so an expert's amax covers all of its layer's tokens, and no expert is
left without one.
Max is exact, so reducing dense amax over the world and expert amax over the edp replicas gives
the same result at every layout, given bitwise-identical activations.
Where a recipe's `act_headroom` applies (eprt.quant.act_headroom), the inputs' block amax are
also counted in histograms (summed over the ranks: exact), and once a layer's statistics are
final each such amax is replaced by its headroom amax.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from eprt.errors import EprtError
from eprt.kernels.cpu_workers import for_each
from eprt.models.moe import Experts
from eprt.models.taps import KVTaps, tapped
from eprt.parallel import ParallelState
from eprt.quant.act_headroom import ActHeadroom
from eprt.quant.numerics import abs_amax


class CalibrationError(EprtError):
    """Calibration recorded something no scale can be made of."""


def segment_amax(x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """abs-max of each expert's rows: [count] fp32 (0 for an expert with no rows)."""
    count = tokens_per_expert.shape[0]
    out = torch.zeros(count, dtype=torch.float32, device=x_sorted.device)
    if not x_sorted.shape[0]:
        return out
    if x_sorted.device.type != "cpu":  # one pass over every row, as one kernel
        expert_of_row = torch.repeat_interleave(torch.arange(count, device=x_sorted.device), tokens_per_expert)
        return out.scatter_reduce_(0, expert_of_row, x_sorted.abs().amax(dim=-1).float(), "amax")
    # on CPU each expert's rows on a worker, without an |x| copy (a max is exact: the same value)
    ends = torch.cumsum(tokens_per_expert, 0).tolist()
    starts = [0, *ends[:-1]]

    def expert(e: int, _) -> None:
        out[e] = abs_amax(x_sorted[starts[e] : ends[e]])

    for_each([e for e in range(count) if ends[e] > starts[e]], lambda: None, expert, x_sorted.device)
    return out


def device_of(module: nn.Module) -> torch.device:
    """Where `module` computes: its statistics live there, so neither the observers nor the
    reduction over the ranks (NCCL takes device tensors only) move a tensor."""
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return torch.device("cpu")


class Calibrator:
    """Installs observers on a model for the modules a recipe quantizes; `close()` removes them.
    The observers of dense modules and of the KV cache may be called from several threads at once.

    `targets` are module names (dense Linears and `...experts` modules); `kv` adds the keys and
    values of every attention layer; `all_experts` (--calibrate-all-experts): each expert's amax
    also takes the tokens the layer-major engine runs through every expert for statistics
    (`every_expert_observer`, eprt.quant.loop.passes.all_experts), counted apart in `expert_all_tokens`;
    `headroom`: the targets whose input amax take activation headroom, each with its settings and
    input block size (`headroom_targets`).
    """

    def __init__(
        self,
        model: nn.Module | None,
        targets: list[str],
        kv: bool,
        all_experts: bool = False,
        headroom: dict[str, tuple[ActHeadroom, int]] | None = None,
    ):
        self.input_amax: dict[str, torch.Tensor] = {}
        self.expert_amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.expert_tokens: dict[str, torch.Tensor] = {}  # tokens the router sent to each expert
        self.expert_all_tokens: dict[str, torch.Tensor] = {}  # tokens each expert saw for statistics only
        self.all_experts = all_experts
        self.kv_amax: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.targets, self.kv = targets, kv
        self.headroom = headroom or {}
        # the block amax histograms of the headroom targets' inputs, until their layer is final
        self.input_hist: dict[str, torch.Tensor] = {}
        self.expert_hist: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        # the dense modules and the attention run one sequence per thread, side by side: a max is
        # the same in any order, but an update in place must not interleave with another
        self._lock = threading.Lock()
        self._taps = contextlib.ExitStack()
        if model is not None:
            self.observe(model)

    def observe(self, module: nn.Module, prefix: str = "") -> None:
        """Observe the targets inside `module`, whose modules are named `prefix` + their name in it
        (one decoder layer at a time in a layer-by-layer run, the whole model otherwise)."""
        for name in self.targets:
            if name.startswith(prefix):
                target = module.get_submodule(name[len(prefix) :])
                if isinstance(target, Experts):
                    self._observe_experts(name, target)
                else:
                    self._observe_input(name, target)
        if self.kv:
            for name, sub in module.named_modules(prefix=prefix.rstrip(".")):
                if isinstance(getattr(sub, "taps", None), KVTaps):
                    self._observe_kv(name, sub)

    @contextlib.contextmanager
    def observing(self, module: nn.Module, prefix: str = "") -> Iterator[None]:
        """`observe` while the context lasts."""
        self.observe(module, prefix)
        try:
            yield
        finally:
            self.close()

    def _raise(self, held: torch.Tensor, amax: torch.Tensor) -> None:
        """held = max(held, amax), in place: from several threads at once, one at a time."""
        with self._lock:
            torch.maximum(held, amax, out=held)

    def _observe_input(self, name: str, module: nn.Module) -> None:
        self.input_amax.setdefault(name, torch.zeros((), dtype=torch.float32, device=device_of(module)))

        if name in self.headroom:
            settings, _ = self.headroom[name]
            self.input_hist.setdefault(name, torch.zeros(settings.bins, dtype=torch.int64, device=device_of(module)))

        def hook(_module, args):
            x = args[0]
            if x.numel():
                self._raise(self.input_amax[name], abs_amax(x.detach()))
                if name in self.headroom:
                    settings, block = self.headroom[name]
                    counts = settings.histogram(x, block)
                    with self._lock:
                        self.input_hist[name] += counts

        self._taps.callback(module.register_forward_pre_hook(hook).remove)

    def _observe_experts(self, name: str, experts: Experts) -> None:
        zeros = lambda dtype: torch.zeros(experts.count, dtype=dtype, device=device_of(experts))  # noqa: E731
        self.expert_amax.setdefault(name, (zeros(torch.float32), zeros(torch.float32)))
        self.expert_tokens.setdefault(name, zeros(torch.int64))
        if name in self.headroom:
            settings, _ = self.headroom[name]
            hist = lambda: torch.zeros(experts.count, settings.bins, dtype=torch.int64, device=device_of(experts))  # noqa: E731
            self.expert_hist.setdefault(name, (hist(), hist()))

        def observer(x_sorted, h_sorted, tokens_per_expert):
            x_amax, h_amax = self.expert_amax[name]  # each expert's input's, its activation's
            torch.maximum(x_amax, segment_amax(x_sorted.detach(), tokens_per_expert), out=x_amax)
            torch.maximum(h_amax, segment_amax(h_sorted.detach(), tokens_per_expert), out=h_amax)
            self.expert_tokens[name] += tokens_per_expert.to(torch.int64)
            if name in self.headroom:
                expert_of_row = torch.repeat_interleave(
                    torch.arange(experts.count, device=x_sorted.device), tokens_per_expert
                )
                self._count_blocks(name, expert_of_row, experts.count, x_sorted, h_sorted)

        self._taps.enter_context(tapped(experts, routed=observer))

    def every_expert_observer(
        self, name: str, experts: Experts
    ) -> Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], None]:
        """The `every_expert` tap of experts module `name`: the statistics-only rows of
        --calibrate-all-experts go into the same amax as the routed ones (a max of both), their
        count into `expert_all_tokens`."""
        self.expert_all_tokens.setdefault(
            name, torch.zeros(experts.count, dtype=torch.int64, device=device_of(experts))
        )

        def observer(e, x, h, _rows_per_unit):  # a max and a count: the units need not be told apart
            x_amax, h_amax = self.expert_amax[name]
            x_amax[e] = torch.maximum(x_amax[e], x.detach().abs().amax().float())
            h_amax[e] = torch.maximum(h_amax[e], h.detach().abs().amax().float())
            self.expert_all_tokens[name][e] += x.shape[0]
            if name in self.headroom:
                expert_of_row = torch.full((x.shape[0],), e, dtype=torch.long, device=x.device)
                self._count_blocks(name, expert_of_row, experts.count, x, h)

        return observer

    def _count_blocks(self, name: str, expert_of_row: torch.Tensor, count: int, x: torch.Tensor, h: torch.Tensor):
        """Add rows x (the experts' input) and h (their activation), each of expert `expert_of_row`,
        to experts module `name`'s block amax histograms."""
        settings, block = self.headroom[name]
        for held, rows in zip(self.expert_hist[name], (x, h)):
            held += settings.histograms(rows, expert_of_row, count, block)

    def _observe_kv(self, name: str, attn: nn.Module) -> None:
        zero = lambda: torch.zeros((), dtype=torch.float32, device=device_of(attn))  # noqa: E731
        self.kv_amax.setdefault(name, (zero(), zero()))

        def observer(k, v):
            k_amax, v_amax = self.kv_amax[name]
            if k.numel():
                self._raise(k_amax, abs_amax(k.detach()))
                self._raise(v_amax, abs_amax(v.detach()))

        self._taps.enter_context(tapped(attn, observe=observer))

    def amax_by_name(self) -> dict[str, torch.Tensor]:
        """Every recorded amax, named as the module and what it measures."""
        out = {f"{m} (input)": t for m, t in self.input_amax.items()}
        for m, (x_amax, h_amax) in self.expert_amax.items():
            out[f"{m} (gate/up input)"], out[f"{m} (down input)"] = x_amax, h_amax
        for m, (k, v) in self.kv_amax.items():
            out[f"{m} (keys)"], out[f"{m} (values)"] = k, v
        return out

    def check_finite(self, rank: int, prefix: str = "") -> None:
        """Refuse a NaN or infinite amax (of the modules under `prefix`): its scale would be NaN,
        and export would fail only at the end."""
        for what, t in self.amax_by_name().items():
            if what.startswith(prefix) and not torch.isfinite(t).all():
                raise CalibrationError(
                    f"{what}: calibration on rank {rank} recorded a non-finite amax ({t.max().item()}); the model "
                    "computes NaN or infinity here: check the checkpoint's weights for NaN/Inf, or calibrate with "
                    "--dtype fp32 if bf16 overflows"
                )

    def reduce(self, state: ParallelState) -> None:
        """Dense and KV amax: max over the world; experts: max (and token sum) over the edp replicas."""
        for t in [*self.input_amax.values(), *(x for pair in self.kv_amax.values() for x in pair)]:
            state.all_reduce(t, over="dp", op=dist.ReduceOp.MAX)
        for name, pair in self.expert_amax.items():
            for t in pair:
                state.all_reduce(t, over="edp", op=dist.ReduceOp.MAX)
            state.all_reduce(self.expert_tokens[name], over="edp", op=dist.ReduceOp.SUM)
            if name in self.expert_all_tokens:
                state.all_reduce(self.expert_all_tokens[name], over="edp", op=dist.ReduceOp.SUM)
        self._take_headroom(state, "")

    def reduce_amax(self, state: ParallelState, prefix: str) -> None:
        """The amax of the modules under `prefix` (one layer, once its steps are done) made final
        before the run ends, as `reduce` makes them: the quality report quantizes the layer with
        them. Max is exact and idempotent, so `reduce` at the end changes them no further; token
        counts are summed there only. A rank's non-finite amax is refused first, as at the end."""
        self.check_finite(state.rank, prefix)
        under = lambda d: [v for m, v in d.items() if m.startswith(prefix)]  # noqa: E731
        for t in [*under(self.input_amax), *(x for pair in under(self.kv_amax) for x in pair)]:
            state.all_reduce(t, over="dp", op=dist.ReduceOp.MAX)
        for t in (x for pair in under(self.expert_amax) for x in pair):
            state.all_reduce(t, over="edp", op=dist.ReduceOp.MAX)
        self._take_headroom(state, prefix)

    def _take_headroom(self, state: ParallelState, prefix: str) -> None:
        """Each headroom target's amax under `prefix` (already reduced over the ranks) replaced by its
        headroom amax, from its histogram summed over the ranks; the histograms are then dropped,
        so a later reduction leaves the amax as they are (the same on every rank: max keeps them)."""
        for name in [m for m in self.input_hist if m.startswith(prefix)]:
            counts = state.all_reduce(self.input_hist.pop(name), over="dp", op=dist.ReduceOp.SUM)
            amax = self.input_amax[name]
            amax.copy_(self.headroom[name][0].amax(counts, amax))
        for name in [m for m in self.expert_hist if m.startswith(prefix)]:
            settings = self.headroom[name][0]
            for counts, amax in zip(self.expert_hist.pop(name), self.expert_amax[name]):
                counts = state.all_reduce(counts, over="edp", op=dist.ReduceOp.SUM)
                for e in range(amax.shape[0]):
                    amax[e] = settings.amax(counts[e], amax[e])

    def close(self) -> None:
        self._taps.close()
