"""Mixture-of-experts block: router, routed experts, dispatcher, optional shared experts.

The dispatcher seam: a block calls `self.dispatcher(x_TD, topk_ids_TK, topk_weights_TK, self.experts)`
with GLOBAL expert ids (int64) and fp32 weights, and gets back the routed output [T, D] in fp32.
`LocalDispatcher` runs every expert in this process; an expert-parallel dispatcher sends each
token to the rank holding its experts and calls that rank's `Experts` on what arrives.
"""

from __future__ import annotations

import torch
from torch import nn

from eprt.errors import ConfigError
from eprt.kernels import combine, grouped_mm, permute, unit_act, unit_mlp
from eprt.layout import GATED_SILU, ClampedSwiGLU, ExpertPieces, SwiGLULimit
from eprt.models.balance import Balance, BalanceGroup, Unbalanced
from eprt.models.layers import ClampedSwiGLUAct, GatedMLP, Linear, RMSNorm, SiLUMulLimit, relu2, silu_mul
from eprt.models.taps import ExpertsTaps
from eprt.parallel.placement import ExpertPlacement


def held_experts(expert_range: tuple[int, int] | None, num_experts: int) -> tuple[int, int]:
    """(first, count) of the routed experts a model holds: `expert_range`, or (no range given) all of them."""
    return expert_range or ExpertPlacement(num_experts).range


def expert_activation(pieces: ExpertPieces):
    """The activation `pieces` names, as the kernels call it: act(gate, up) when gated, else act(up)."""
    a = pieces.activation
    if isinstance(a, ClampedSwiGLU) and pieces.gated:
        return ClampedSwiGLUAct(a.alpha, a.limit)
    if isinstance(a, SwiGLULimit) and pieces.gated:
        return SiLUMulLimit(a.limit)
    found = {("silu", True): silu_mul, ("relu2", False): relu2}.get((a, pieces.gated))
    if found is None:
        raise ConfigError(f"routed experts: no {'gated' if pieces.gated else 'ungated'} activation {a!r} in eprt")
    return found


class Experts(nn.Module):
    """Experts [first, first + count) of num_experts, stacked as `pieces` describes them
    (eprt.layout.ExpertPieces): `w_in` [count, 2I, D] (each expert's gate rows, then its up
    rows) or, not gated, [count, I, D] (up); `w_out` [count, D, I] (down); where the experts
    have biases, `b_in` [count, 2I or I] and `b_out` [count, D]. Each computes
    down(act(gate x, up x)) (not gated: down(act(up x))), act the pieces' unless given.
    The parameters carry the pieces' names (`pieces.leaves`: w13 and w2 for gated experts)."""

    def __init__(
        self,
        num_experts: int,
        first: int,
        count: int,
        hidden: int,
        width: int,
        act=None,
        pieces: ExpertPieces = GATED_SILU,
    ):
        super().__init__()
        assert 0 <= first and 0 < count and first + count <= num_experts, (first, count, num_experts)
        self.num_experts, self.first, self.count = num_experts, first, count
        self.pieces = pieces
        leaf_in, leaf_out = pieces.leaves
        self.register_parameter(leaf_in, nn.Parameter(torch.empty(count, pieces.fan * width, hidden)))
        self.register_parameter(leaf_out, nn.Parameter(torch.empty(count, hidden, width)))
        if pieces.bias:
            self.register_parameter(f"{leaf_in}_bias", nn.Parameter(torch.empty(count, pieces.fan * width)))
            self.register_parameter(f"{leaf_out}_bias", nn.Parameter(torch.empty(count, hidden)))
        self.act = act or expert_activation(pieces)
        self.taps = ExpertsTaps()  # where quantization observes or replaces a tensor (eprt.models.taps)

    @property
    def w_in(self) -> nn.Parameter:
        """The projection the experts' input goes through: gate and up end to end, or up."""
        return getattr(self, self.pieces.leaves[0])

    @property
    def w_out(self) -> nn.Parameter:
        """The down projection."""
        return getattr(self, self.pieces.leaves[1])

    @property
    def b_in(self) -> nn.Parameter | None:
        return getattr(self, f"{self.pieces.leaves[0]}_bias") if self.pieces.bias else None

    @property
    def b_out(self) -> nn.Parameter | None:
        return getattr(self, f"{self.pieces.leaves[1]}_bias") if self.pieces.bias else None

    def projections(self) -> dict[str, nn.Parameter]:
        """The stacked weights by their names (`pieces.leaves`), the input's projection first."""
        return dict(zip(self.pieces.leaves, (self.w_in, self.w_out)))

    def _input(self, x_sorted: torch.Tensor) -> torch.Tensor:
        return x_sorted if self.taps.input is None else self.taps.input(x_sorted)

    def _act(self, *gate_up: torch.Tensor) -> torch.Tensor:
        """act(gate, up) (or act(up)), as the down projection reads it."""
        h = self.act(*gate_up)
        return h if self.taps.activation is None else self.taps.activation(h)

    def activation_group(self, what: str) -> Balance:
        """AWQ's group of each expert's activation (eprt.models.balance), as GatedMLP's: its up rows
        / s, its down columns * s, each expert a scale of its own."""
        if self.act is not silu_mul:
            return Unbalanced(self, "their down input: the activation is not SwiGLU's")
        return BalanceGroup(what, self, (self,))

    def forward(self, x_sorted: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """Rows of x sorted by local expert, tokens_per_expert [count] -> rows of output, in x's dtype."""
        offsets = torch.cumsum(tokens_per_expert, dim=0, dtype=torch.int32)
        z = grouped_mm(self._input(x_sorted), self.w_in, offsets, self.b_in)
        h = self._act(*z.chunk(2, dim=-1)) if self.pieces.gated else self._act(z)
        if self.taps.routed is not None:
            self.taps.routed(x_sorted, h, tokens_per_expert)
        return grouped_mm(h, self.w_out, offsets, self.b_out)

    def forward_units(self, x_sorted: torch.Tensor, rows_per_unit_LU: torch.Tensor) -> torch.Tensor:
        """Rows sorted by (local expert, work unit), rows_per_unit_LU [count, U] -> rows of output.

        Each (expert, unit) block is computed as if alone (`unit_mlp`): the rows a matmul sees are
        the unit's, whatever else this call holds, so a deterministic kernel gives every layout
        the same bits."""
        x_in, gated = self._input(x_sorted), self.pieces.gated
        h, y = unit_mlp(
            x_in, self.w_in, self.w_out, self._act, rows_per_unit_LU, gated=gated, b_in=self.b_in, b_out=self.b_out
        )
        if self.taps.routed is not None:
            self.taps.routed(x_sorted, h, rows_per_unit_LU.sum(1))
        if self.taps.units is not None:
            self.taps.units(x_sorted, h, rows_per_unit_LU)
        if self.taps.units_output is not None:
            self.taps.units_output(x_sorted, rows_per_unit_LU, y)
        return y

    def observe_every_expert(self, x_sorted: torch.Tensor, rows_per_unit_U: torch.Tensor) -> None:
        """Statistics only: every expert held here over all the rows (sorted by work unit,
        rows_per_unit_U [U]), each (expert, unit) computed as if alone (`unit_act`); each
        expert's activation goes to the `every_expert` tap and is dropped, no down projection runs."""
        if self.taps.every_expert is None or not x_sorted.shape[0]:
            return
        b_in = self.b_in
        for e in range(self.count):
            one = {"gated": self.pieces.gated, "b_in": None if b_in is None else b_in[e : e + 1]}
            self.taps.every_expert(
                e,
                x_sorted,
                unit_act(x_sorted, self.w_in[e : e + 1], self._act, rows_per_unit_U, **one),
                rows_per_unit_U,
            )


class LocalDispatcher:
    """Every routed expert lives in this process: permute, run, combine."""

    def __call__(
        self, x_TD: torch.Tensor, topk_ids_TK: torch.Tensor, topk_weights_TK: torch.Tensor, experts: Experts
    ) -> torch.Tensor:
        if experts.count != experts.num_experts:
            raise ConfigError(
                f"this model holds experts [{experts.first}, {experts.first + experts.count}) of "
                f"{experts.num_experts}; a local forward needs all of them: load without expert_range, "
                "or install an expert-parallel dispatcher with model.set_dispatcher(...)"
            )
        x_sorted, tokens_per_expert, order = permute(x_TD, topk_ids_TK, experts.num_experts)
        return combine(experts(x_sorted, tokens_per_expert), order, topk_weights_TK)


class MoE(nn.Module):
    def __init__(self, gate: nn.Module, experts: Experts, shared_experts: nn.Module | None = None):
        super().__init__()
        self.gate = gate
        self.experts = experts
        self.shared_experts = shared_experts
        self.dispatcher = LocalDispatcher()

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        x_TD = x_BTD.reshape(-1, x_BTD.shape[-1])
        experts_in_TD, topk_ids_TK, topk_weights_TK = self.route(x_TD)
        routed_TD = self.dispatcher(experts_in_TD, topk_ids_TK, topk_weights_TK, self.experts)
        return self.finish(x_TD, routed_TD).view_as(x_BTD)

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(what the routed experts read, top-k global expert ids, top-k fp32 weights)."""
        topk_ids_TK, topk_weights_TK = self.gate(x_TD)
        return x_TD, topk_ids_TK, topk_weights_TK

    def finish(self, x_TD: torch.Tensor, routed_TD: torch.Tensor) -> torch.Tensor:
        """The block's output from its input and the fp32 weighted sum of the routed experts'
        outputs: that sum rounded once, then the shared experts added in the model dtype, as
        the reference does."""
        y_TD = self.routed_out(routed_TD.to(x_TD.dtype))
        if self.shared_experts is not None:
            y_TD = y_TD + self.shared_experts(x_TD)
        return y_TD

    def routed_out(self, y_TD: torch.Tensor) -> torch.Tensor:
        return y_TD

    def balance_groups(self, norm: nn.Module) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): the block's input, read by the router, every routed
        expert's gate/up and the shared experts'; then the experts' activations. Routed experts with
        biases or without a gate (GPT-OSS's, Nemotron-H's) are left out: the search scores gated
        experts without biases."""
        if self.experts.pieces.bias or not self.experts.pieces.gated:
            return [Unbalanced(self.experts, "input and activation: the search models gated experts without biases")]
        groups = [BalanceGroup("MoE input", norm, self.input_readers())]
        groups.append(self.experts.activation_group("routed experts' activation"))
        groups += [m.activation_group("shared experts' activation") for m in self.shared_mlps()]
        return groups

    def input_readers(self) -> tuple[nn.Module, ...]:
        return (self.gate, self.experts, *(r for m in self.shared_mlps() for r in m.input_readers()))

    def shared_mlps(self) -> list[GatedMLP]:
        return [] if self.shared_experts is None else [self.shared_experts]


class GatedSharedExpertMoE(MoE):
    """Routed experts plus one shared expert scaled per token by sigmoid(shared_expert_gate x)
    (Qwen2-MoE, Qwen3-Next, Qwen3.5-MoE)."""

    def __init__(self, gate: nn.Module, experts: Experts, shared_expert: nn.Module, hidden: int):
        super().__init__(gate, experts)
        self.shared_expert = shared_expert
        self.shared_expert_gate = Linear(hidden, 1)

    def finish(self, x_TD: torch.Tensor, routed_TD: torch.Tensor) -> torch.Tensor:
        # sigmoid over a full row per token, not over the [T, 1] column: a vectorized sigmoid rounds
        # its tail elements apart from the rest, so a token's gate would depend on the token count
        gate_TD = torch.sigmoid(self.shared_expert_gate(x_TD).expand(-1, x_TD.shape[-1]))
        shared_TD = gate_TD * self.shared_expert(x_TD)
        return self.routed_out(routed_TD.to(x_TD.dtype)) + shared_TD

    def input_readers(self) -> tuple[nn.Module, ...]:
        return (*super().input_readers(), self.shared_expert_gate)

    def shared_mlps(self) -> list[GatedMLP]:
        return [self.shared_expert]


class LatentMoE(MoE):
    """Routed experts that work in a smaller latent space (Kimi-K3, Nemotron-3 Super and Ultra):
    the router reads x, the experts read z = down(x); their combined output is normalized (when the
    model has the norm) and projected back up. The shared experts read x. The projections carry
    the checkpoint's names (`projections`: down's, up's; Kimi-K3's unless given)."""

    def __init__(
        self,
        gate: nn.Module,
        experts: Experts,
        shared_experts: nn.Module | None,
        hidden: int,
        latent: int,
        norm_eps: float | None,
        projections: tuple[str, str] = ("routed_expert_down_proj", "routed_expert_up_proj"),
    ):
        super().__init__(gate, experts, shared_experts)
        self.projections = projections
        self.add_module(projections[0], Linear(hidden, latent))
        self.routed_expert_norm = RMSNorm(latent, norm_eps) if norm_eps is not None else None
        self.add_module(projections[1], Linear(latent, hidden))

    def route(self, x_TD: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        topk_ids_TK, topk_weights_TK = self.gate(x_TD)
        return getattr(self, self.projections[0])(x_TD), topk_ids_TK, topk_weights_TK

    def balance_groups(self, norm: nn.Module) -> list[Balance]:
        return [Unbalanced(self, "the routed experts read a projection of the norm's output")]

    def routed_out(self, y_TZ: torch.Tensor) -> torch.Tensor:
        if self.routed_expert_norm is not None:
            y_TZ = self.routed_expert_norm(y_TZ)
        return getattr(self, self.projections[1])(y_TZ)
