"""RMSNorm variants: plain `w * norm(x)`, zero-centred `(1 + w) * norm(x)`, and gated."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x) in fp32."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, zero_centered: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps, self.zero_centered = eps, zero_centered

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.zero_centered:
            return (rms(x, self.eps) * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * rms(x, self.eps).to(x.dtype)


class GatedRMSNorm(nn.Module):
    """`w * norm(x) * act(gate)`, the DeltaNet output norm (silu gate, or sigmoid in qwen4_exp)."""

    def __init__(self, dim: int, eps: float, activation: str = "silu"):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps
        self.act = F.silu if activation == "silu" else torch.sigmoid

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        y = self.weight * rms(x, self.eps).to(x.dtype)
        return (y * self.act(gate.float())).to(x.dtype)
