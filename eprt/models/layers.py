"""Building blocks every family shares: the one dense matmul, RMSNorm, the gated MLP and its activations."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from eprt.kernels.backend import matmul_dtype
from eprt.models.balance import Balance, BalanceGroup, Unbalanced


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T (+ bias), in x's dtype. Every dense matmul of every model goes through here,
    so a kernel can replace it in one place: on a CPU without bf16 arithmetic, bf16 operands are
    multiplied in fp32 (eprt.kernels.backend.matmul_dtype)."""
    wide = matmul_dtype(x.dtype, x.device)
    if wide == x.dtype:
        return F.linear(x, weight, bias)
    return F.linear(x.to(wide), weight.to(wide), None if bias is None else bias.to(wide)).to(x.dtype)


class Linear(nn.Module):
    """A weight [out, in] (and optional bias) applied through `linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32, round back to the input dtype, then scale: the reference's casts.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm scaled by (1 + weight) (Qwen3-Next, Qwen3.5: the weight is stored centered on 0),
    the scale applied in fp32 before the one cast back, as the reference does."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)


def silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


def relu2(up: torch.Tensor) -> torch.Tensor:
    """relu(up)^2: Nemotron-H's experts, which are not gated."""
    return torch.square(F.relu(up))


class ClampedSwiGLUAct:
    """(clamp(up, -limit, limit) + 1) * g * sigmoid(alpha g), g = clamp(gate, max=limit): GPT-OSS's
    and MiniMax-M3's gated activation (eprt.layout.ClampedSwiGLU holds its knobs), in the
    reference's order of operations."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


class SiLUMulLimit:
    """silu(min(gate, limit)) * clamp(up, -limit, limit): DeepSeek-V4's bounded SwiGLU, routed and
    shared experts alike (eprt.layout.SwiGLULimit holds its knob)."""

    def __init__(self, limit: float):
        self.limit = limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return F.silu(gate.clamp(max=self.limit)) * up.clamp(min=-self.limit, max=self.limit)


class SiTU:
    """Kimi-K3's gated activation, in fp32 and cast back:
    [b tanh(gate / b) sigmoid(gate)] * [bl tanh(up / bl)] (up unbounded when bl is None)."""

    def __init__(self, beta: float, linear_beta: float | None):
        self.beta, self.linear_beta = beta, linear_beta

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g, u = gate.float(), up.float()
        if self.linear_beta is not None:
            u = self.linear_beta * torch.tanh(u / self.linear_beta)
        return (self.beta * torch.tanh(g / self.beta) * torch.sigmoid(g) * u).to(gate.dtype)


class ClampedSwiGLU:
    """GPT-OSS's and MiniMax-M3's gated activation, in the model dtype as the reference computes it:
    (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit)."""

    def __init__(self, alpha: float, limit: float):
        self.alpha, self.limit = alpha, limit

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        g = gate.clamp(max=self.limit)
        u = up.clamp(min=-self.limit, max=self.limit)
        return (u + 1.0) * (g * torch.sigmoid(g * self.alpha))


class GatedMLP(nn.Module):
    """down(act(gate x, up x)), act silu(gate) * up unless given: the dense layers and the shared experts."""

    def __init__(self, hidden: int, width: int, act=silu_mul):
        super().__init__()
        self.gate_proj = Linear(hidden, width)
        self.up_proj = Linear(hidden, width)
        self.down_proj = Linear(width, hidden)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x), self.up_proj(x)))

    def balance_groups(self, norm: nn.Module) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): gate/up read the norm's output; down reads the activation."""
        return [BalanceGroup("MLP input", norm, self.input_readers()), self.activation_group("MLP activation")]

    def input_readers(self) -> tuple[nn.Module, ...]:
        return self.gate_proj, self.up_proj

    def activation_group(self, what: str) -> Balance:
        """down reads silu(gate) * up, linear in up: up's rows / s, down's columns * s. Another
        activation (Kimi's SiTU bounds up through tanh) is not linear in up."""
        if self.act is not silu_mul:
            return Unbalanced(self.down_proj, "its input: the activation is not SwiGLU's")
        return BalanceGroup(what, self.up_proj, (self.down_proj,))


class FusedGatedMLP(nn.Module):
    """GatedMLP with gate and up in one projection, gate rows then up rows (`gate_up_proj`), as
    transformers 5 stores some families' dense MLPs and shared experts."""

    def __init__(self, hidden: int, width: int, act=silu_mul):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * width)
        self.down_proj = Linear(width, hidden)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate, up))

    def balance_groups(self, norm: nn.Module) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): gate_up reads the norm's output; up's rows are half
        of one projection, which the fold does not split: down's input is left out."""
        return [BalanceGroup("MLP input", norm, self.input_readers()), self.activation_group("MLP activation")]

    def input_readers(self) -> tuple[nn.Module, ...]:
        return (self.gate_up_proj,)

    def activation_group(self, what: str) -> Balance:
        return Unbalanced(self.down_proj, "its input: gate and up are one projection (gate_up_proj)")


class UngatedMLP(nn.Module):
    """down(act(up x)), no gate: Nemotron-H's dense layers and shared experts (act relu(up)^2)."""

    def __init__(self, hidden: int, width: int, act=relu2):
        super().__init__()
        self.up_proj = Linear(hidden, width)
        self.down_proj = Linear(width, hidden)
        self.act = act

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))

    def balance_groups(self, norm: nn.Module) -> list[Balance]:
        """AWQ's groups (eprt.models.balance): up reads the norm's output; down reads act(up x),
        which a scale on up's rows does not pass through unchanged."""
        return [BalanceGroup("MLP input", norm, self.input_readers()), self.activation_group("MLP activation")]

    def input_readers(self) -> tuple[nn.Module, ...]:
        return (self.up_proj,)

    def activation_group(self, what: str) -> Balance:
        return Unbalanced(self.down_proj, "its input: the activation is not SwiGLU's")
