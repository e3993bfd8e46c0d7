"""The SwiGLU MLP: dense layers and shared experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, hidden: int, inter: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor, ctx=None) -> torch.Tensor:  # ctx: a step context, as SparseMoE takes
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
