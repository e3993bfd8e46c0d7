"""Rotary position embedding (rotate-half convention), full or partial (the first `rotary_dim` dims).

Multimodal rope (qwen3_5_moe, qwen4_exp) reduces to this for text, where the temporal, height and
width positions are equal.
"""

from __future__ import annotations

import torch
from torch import nn

from moestream.kernels import ops


class Rotary(nn.Module):
    def __init__(self, head_dim: int, partial_factor: float, theta: float):
        super().__init__()
        self.rotary_dim, self.theta = int(head_dim * partial_factor), theta
        self.init_buffers(None)

    def init_buffers(self, device) -> None:
        steps = torch.arange(0, self.rotary_dim, 2, dtype=torch.float32, device=device) / self.rotary_dim
        self.register_buffer("inv_freq", 1.0 / self.theta ** steps, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> cos, sin [T, rotary_dim]."""
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, head_dim]; cos, sin [T, rotary_dim]."""
    return ops.rotary(x, cos, sin)
