"""The SwiGLU MLP: dense layers and shared experts."""

from __future__ import annotations

import torch
from torch import nn

from moestream.kernels import ops
from moestream.layers.linear import Linear


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = Linear(hidden, inter, bias=False)
        self.up_proj = Linear(hidden, inter, bias=False)
        self.down_proj = Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:  # ctx: a step context, as SparseMoE takes
        return self.down(self.gate_proj(x), self.up_proj(x))

    def down(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """The output from the gate and up products (a caller that made them in a fused projection)."""
        return ops.glu_linear(gate, up, self.down_proj.weight)
